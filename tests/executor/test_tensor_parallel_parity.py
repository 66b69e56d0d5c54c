"""Tensor parallelism over processes (gloo on the CPU): a sharded replica gives the tokens one
rank gives.

- The default model at TP 3 (its 9 query and 3 KV heads divide by 3), float32, equals TP 1's
  greedy tokens and logprobs under chunked prefill with prefix caching, and under recompute
  and swap preemption.
- A random Llama with 8 query and 2 KV heads and an untied LM head at TP 2 and at TP 4 (each
  KV head replicated on two ranks) equals its TP 1 output.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from helpers import make_engine
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from iterserve.config import EngineConfig
from iterserve.engine.llm_engine import IterationError
from iterserve.engine.sampling_params import SamplingParams
from iterserve.executor.build import LoadedModel, build
from iterserve.executor.tensor_parallel import WORKER_MODULE, TensorParallelError
from iterserve.models.loader import resolve_model_dir

pytestmark = pytest.mark.model

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True)


def _workers() -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if WORKER_MODULE in " ".join(p.cmdline())
    ]


def _generate(
    loaded: LoadedModel, prompts: list[list[int]], **engine_kwargs: Any
) -> tuple[dict[str, tuple[list[int], list[float]]], Any]:
    """Greedy tokens and their logprobs per request; the engine (for its counters)."""
    num_kv_blocks = engine_kwargs.pop("num_kv_blocks", loaded.num_kv_blocks)
    engine = make_engine(loaded, num_kv_blocks=num_kv_blocks, **engine_kwargs)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    results: dict[str, tuple[list[int], list[float]]] = {}
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                completion = out.outputs[0]
                assert completion.logprobs is not None
                logprobs = [lp.logprob for lp in completion.logprobs]
                results[out.request_id] = (completion.token_ids, logprobs)
        if not engine.has_unfinished_requests():
            break
    assert engine.scheduler.kv.pool.num_free_blocks == num_kv_blocks
    return results, engine


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for request_id, (tokens, logprobs) in want.items():
        assert got[request_id][0] == tokens, request_id
        torch.testing.assert_close(got[request_id][1], logprobs, atol=2e-4, rtol=0)


@pytest.fixture(scope="module")
def random_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama with 8 query and 2 KV heads (head_dim 16), an untied LM head and the
    default model's tokenizer, as a Hugging Face directory."""
    path = tmp_path_factory.mktemp("llama-8q-2kv")
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    HFLlama(config).save_pretrained(str(path))
    default = resolve_model_dir("default")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (default / name).is_file():
            shutil.copy(default / name, path / name)
    return path


def test_a_random_8q_2kv_llama_at_tp2_and_tp4_equals_tp1(random_llama_dir: Path) -> None:
    # First in the module: a process holds one tensor-parallel replica at a time.
    results = {}
    for size in (1, 2, 4):
        loaded = build(
            EngineConfig.from_kwargs(
                model=str(random_llama_dir),
                dtype="float32",
                num_kv_blocks=32,
                swap_space=0,
                tensor_parallel_size=size,
            )
        )
        try:
            if size == 4:  # 2 KV heads over 4 ranks: one each, replicated
                assert loaded.driver.kv_cache.key[0].shape[0] == 1
            prompts = [[(37 * i + 11 * j) % 49152 for j in range(5 + 7 * i)] for i in range(4)]
            results[size], _ = _generate(loaded, prompts, max_num_batched_tokens=16, max_num_seqs=4)
        finally:
            loaded.close()
        assert _workers() == []
    _assert_same(results[2], results[1])
    _assert_same(results[4], results[1])


def test_a_hung_worker_times_out_the_step_and_fails_the_replica(
    random_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopped worker: the driver's collective gives up after ITERSERVE_TP_TIMEOUT_S, the
    step's requests fail, every later step fails at once and no worker is left. Start-up is
    not bound by it: a worker held up longer while it starts (a slow load) joins in time."""
    monkeypatch.setenv("ITERSERVE_TP_TIMEOUT_S", "3")
    config = EngineConfig.from_kwargs(
        model=str(random_llama_dir), dtype="float32", num_kv_blocks=32, tensor_parallel_size=2
    )
    held: list[float] = []

    def hold_the_worker_at_start() -> None:
        deadline = time.monotonic() + 30
        while not (found := _workers()) and time.monotonic() < deadline:
            time.sleep(0.01)
        found[0].suspend()
        time.sleep(4.0)  # past the step timeout
        found[0].resume()
        held.append(4.0)

    holder = threading.Thread(target=hold_the_worker_at_start)
    holder.start()
    loaded = build(config)
    holder.join()
    assert held == [4.0]
    try:
        cores = len(os.sched_getaffinity(0))
        assert torch.get_num_threads() == max(1, cores // 2)  # the cores split between ranks
        [worker] = _workers()
        engine = make_engine(loaded, num_kv_blocks=32, max_num_seqs=4)
        engine.add_request("a", [1, 2, 3], GREEDY)
        engine.step()
        worker.suspend()
        start = time.monotonic()
        with pytest.raises(IterationError) as failed:
            while engine.has_unfinished_requests():
                engine.step()
        assert 2.5 < time.monotonic() - start < 20
        assert isinstance(failed.value.__cause__, TensorParallelError)
        assert psutil.wait_procs([worker], timeout=10)[1] == []  # killed, not left stopped
        engine.add_request("b", [4, 5], GREEDY)
        start = time.monotonic()
        with pytest.raises(IterationError, match="TensorParallelError"):
            engine.step()
        assert time.monotonic() - start < 1
    finally:
        loaded.close()
    assert _workers() == []


@pytest.fixture(scope="module")
def loaded_tp3() -> Iterator[LoadedModel]:
    loaded = build(
        EngineConfig.from_kwargs(
            dtype="float32", num_kv_blocks=96, swap_space=0.02, tensor_parallel_size=3
        )
    )
    assert len(_workers()) == 2
    yield loaded
    loaded.close()
    assert psutil.wait_procs(_workers(), timeout=10)[1] == []


def _prompts(loaded: LoadedModel) -> list[list[int]]:
    system = "You are a helpful assistant who answers in one short sentence. " * 3
    texts = [system + q for q in ("What is the capital of France?", "Name a prime number.")]
    texts += ["def fibonacci(n):", "word " * 50, "The three primary colours are"]
    return [list(loaded.tokenizer(t).input_ids) for t in texts]


def test_tp3_equals_tp1_under_chunked_prefill_and_prefix_caching(
    loaded_f32: LoadedModel, loaded_tp3: LoadedModel
) -> None:
    prompts = _prompts(loaded_f32)
    settings = {
        "max_num_batched_tokens": 32,
        "max_num_seqs": 4,
        "enable_prefix_caching": True,
        "num_kv_blocks": 96,
    }
    want, _ = _generate(loaded_f32, prompts, **settings)
    got, engine = _generate(loaded_tp3, prompts, **settings)
    _assert_same(got, want)
    assert engine.scheduler.num_prefix_cache_hits > 0  # the shared system prompt was reused


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tp3_equals_tp1_under_preemption(
    loaded_f32: LoadedModel, loaded_tp3: LoadedModel, mode: str
) -> None:
    prompts = _prompts(loaded_f32)
    # 12 blocks of 16 tokens for five requests of 15-60 prompt tokens: some are preempted.
    settings = {
        "num_kv_blocks": 12,
        "preemption_mode": mode,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 8,
    }
    if mode == "swap":
        settings["swap_space"] = 0.02
    want, _ = _generate(loaded_f32, prompts, **settings)
    got, engine = _generate(loaded_tp3, prompts, **settings)
    _assert_same(got, want)
    assert engine.scheduler.num_preemptions_by_cause[mode, "kv"] > 0
