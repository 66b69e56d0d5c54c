"""The offline API and the engine on the real default model: aborts, rejections, CLI."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import psutil
import pytest
from helpers import make_engine

from iterserve.engine.errors import InvalidRequestError
from iterserve.engine.sampling_params import SamplingParams
from iterserve.executor.tensor_parallel import WORKER_MODULE

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def _encode(loaded: Any, text: str) -> list[int]:
    return list(loaded.tokenizer(text).input_ids)


def _run_alone(loaded: Any, prompt: list[int], params: SamplingParams) -> list[int]:
    engine = make_engine(loaded)
    engine.add_request("solo", prompt, params)
    result: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            result = out.outputs[0].token_ids
    return result


@pytest.mark.model
@pytest.mark.parametrize("abort_at", [0, 1, 3, 6, 10])
def test_abort_at_any_point_returns_every_block(loaded_f32: Any, abort_at: int) -> None:
    """Aborts while waiting, mid chunked prefill and while decoding all free their blocks."""
    engine = make_engine(loaded_f32, max_num_batched_tokens=48, max_num_seqs=4)
    prompts = [_encode(loaded_f32, "word " * n) for n in (5, 60, 120, 30, 90, 10)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    finished: dict[str, str | None] = {}
    finished_before_abort: set[str] = set()
    for step in range(200):
        if step == abort_at:
            finished_before_abort = set(finished)
            for out in engine.abort_request(["1", "4", "5"]):
                assert out.finished
                finished[out.request_id] = out.outputs[0].finish_reason
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].finish_reason
        engine.scheduler.check_integrity()
        if not engine.has_unfinished_requests():
            break
    kv = engine.scheduler.kv
    assert kv.pool.num_free_blocks == kv.num_blocks
    assert set(finished) == {str(i) for i in range(6)}, "every request ends"
    for request_id in "145":
        if request_id not in finished_before_abort:
            assert finished[request_id] == "abort"
    for request_id in "023":
        assert finished[request_id] in ("stop", "length")


@pytest.mark.model
def test_abort_frees_blocks_immediately(loaded_f32: Any) -> None:
    engine = make_engine(loaded_f32)
    engine.add_request("a", _encode(loaded_f32, "hello " * 100), GREEDY)
    engine.step()
    kv = engine.scheduler.kv
    assert kv.pool.num_free_blocks < kv.num_blocks
    engine.abort_request("a")
    assert kv.pool.num_free_blocks == kv.num_blocks
    engine.scheduler.check_integrity()
    assert not engine.has_unfinished_requests()


@pytest.mark.model
def test_impossible_requests_are_rejected_while_others_run(loaded_f32: Any) -> None:
    prompts = [_encode(loaded_f32, t) for t in ("The sky is", "Numbers: 1, 2, 3,", "Hello")]
    expected = [_run_alone(loaded_f32, p, GREEDY) for p in prompts]
    engine = make_engine(loaded_f32, num_kv_blocks=32, max_model_len=1024)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    engine.step()
    engine.step()
    bad = [
        ([], GREEDY, "empty"),
        ([1] * 1000, SamplingParams(max_tokens=100), "maximum context length"),
        ([1] * 600, SamplingParams(max_tokens=1), "whole pool has 32 blocks"),
        ([49152], GREEDY, r"\[0, 49152\)"),
    ]
    for prompt, params, message in bad:
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request("bad", prompt, params)
        engine.scheduler.check_integrity()
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    assert [outputs[str(i)] for i in range(3)] == expected


@pytest.mark.model
def test_sequence_longer_than_the_pool_ends_with_length(loaded_f32: Any) -> None:
    """A prompt that fits but whose output outgrows the whole pool stops with 'length'."""
    engine = make_engine(
        loaded_f32, num_kv_blocks=4, block_size=16, max_num_seqs=4, max_num_batched_tokens=64
    )
    prompt = list(range(100, 130))
    params = SamplingParams(max_tokens=100, ignore_eos=True, temperature=0.0)
    engine.add_request("long", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
        engine.scheduler.check_integrity()
    assert final is not None and final.finished
    assert final.outputs[0].finish_reason == "length"
    # Every one of the 64 slots holds a computed token, and the last sampled token is kept.
    assert len(prompt) + len(final.outputs[0].token_ids) == 4 * 16 + 1


@pytest.mark.model
def test_llm_generate_mixed_prompt_forms_in_input_order(loaded_f32: Any) -> None:
    from iterserve import LLM
    from iterserve import SamplingParams as TopLevelSamplingParams

    llm = LLM(
        model="default",
        dtype="float32",
        num_kv_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=32,
        preemption_mode="recompute",
        attention_backend="torch",
    )
    text = "The quick brown fox"
    ids = _encode(loaded_f32, "Lists in Python are")
    params = TopLevelSamplingParams(max_tokens=8, temperature=0.0)
    outs = llm.generate([text, ids, {"prompt_token_ids": [4, 5, 6, 7]}], params)
    assert [o.prompt for o in outs] == [text, None, None]
    assert outs[0].outputs[0].token_ids == _run_alone(loaded_f32, _encode(loaded_f32, text), params)
    assert outs[1].outputs[0].token_ids == _run_alone(loaded_f32, ids, params)
    assert outs[2].outputs[0].token_ids == _run_alone(loaded_f32, [4, 5, 6, 7], params)
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs)
    assert outs[0].outputs[0].text == loaded_f32.tokenizer.decode(
        outs[0].outputs[0].token_ids, skip_special_tokens=True
    )
    # One prompt, per-prompt params, chat, and a prompt rejected before anything runs.
    single = llm.generate(ids, [params])
    assert single[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    chat = llm.chat([{"role": "user", "content": "Say hi."}], params)
    assert chat[0].outputs[0].text
    with pytest.raises(InvalidRequestError):
        llm.generate([text, []], params)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(TypeError):
        LLM(model="default", no_such_option=1)


@pytest.mark.model
def test_cli_generate_prints_text() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "iterserve.cli",
            "generate",
            "--prompt",
            "Hello, my name is",
            "--max-tokens",
            "6",
            "--num-kv-blocks",
            "32",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--- prompt: 'Hello, my name is'" in proc.stdout
    assert "finish_reason=" in proc.stdout
    assert "output tokens in" in proc.stdout


def test_cli_rejects_bad_config_clearly() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "iterserve.cli",
            "generate",
            "--max-num-seqs",
            "64",
            "--max-num-batched-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "must be >= max_num_seqs" in proc.stderr


@pytest.mark.model
def test_llm_close_is_idempotent_and_generate_after_it_raises() -> None:
    from iterserve import LLM

    llm = LLM(model="default", dtype="float32", num_kv_blocks=8, attention_backend="torch")
    assert not llm.closed
    llm.close()
    llm.close()
    assert llm.closed
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        llm.generate("Hello", SamplingParams(max_tokens=1))


@pytest.mark.model
def test_tensor_parallel_llms_one_after_another_in_one_process() -> None:
    """A TP-3 ``LLM`` closed (by its ``with`` block, then by ``close()``) leaves the process
    free for the next one; both give the same greedy tokens."""
    from iterserve import LLM

    kwargs: dict[str, Any] = {
        "dtype": "float32",
        "num_kv_blocks": 16,
        "tensor_parallel_size": 3,
        "attention_backend": "torch",
    }
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(**kwargs) as first:
        want = first.generate("The capital of France is", params)[0].outputs[0].token_ids
    assert first.closed
    second = LLM(**kwargs)
    try:
        got = second.generate("The capital of France is", params)[0].outputs[0].token_ids
        # An interrupt that escapes a step (Ctrl-C reaching the driver alone): the next
        # generate refuses with a clear error instead of entering a desynchronised group.
        real_step = second.engine.step

        def interrupted() -> Any:
            real_step()
            raise KeyboardInterrupt

        second.engine.step = interrupted  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            second.generate("Hello", params)
        second.engine.step = real_step  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="out of step; close"):
            second.generate("Hello", params)
    finally:
        second.close()
    assert got == want
    assert len(want) == 4
    workers = [p for p in psutil.Process().children(recursive=True) if WORKER_MODULE in p.cmdline()]
    assert workers == []
