"""Sampling and output features on the real default model (float32)."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import make_engine

from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.model


def encode(loaded: Any, text: str) -> list[int]:
    return list(loaded.tokenizer(text).input_ids)


def chat_ids(loaded: Any, content: str) -> list[int]:
    tok = loaded.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return list(tok(text, add_special_tokens=False).input_ids)


def run(
    engine: LLMEngine,
    requests: dict[str, tuple[list[int], SamplingParams]],
    stream: dict[str, list[RequestOutput]] | None = None,
) -> dict[str, RequestOutput]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if stream is not None:
                stream.setdefault(out.request_id, []).append(out)
            if out.finished:
                final[out.request_id] = out
        engine.scheduler.check_integrity()
    return final


def test_seeded_sampling_is_reproducible_alone_and_in_a_busy_batch(loaded_f32: Any) -> None:
    prompt = encode(loaded_f32, "Once upon a time in a small village,")
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234)
    alone = run(make_engine(loaded_f32), {"s": (prompt, seeded)})["s"].outputs[0].token_ids
    again = run(make_engine(loaded_f32), {"s": (prompt, seeded)})["s"].outputs[0].token_ids
    assert alone == again
    busy_requests = {
        f"other{i}": (
            encode(loaded_f32, f"Item {i}: " + "word " * (5 * i)),
            SamplingParams(max_tokens=12, temperature=0.9),
        )
        for i in range(6)
    }
    busy_requests["s"] = (prompt, seeded)
    busy = run(make_engine(loaded_f32, max_num_batched_tokens=64, max_num_seqs=8), busy_requests)
    assert busy["s"].outputs[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, seed=4321)
    different = run(make_engine(loaded_f32), {"s": (prompt, other_seed)})["s"].outputs[0].token_ids
    assert different != alone


def test_stop_string_ending_mid_token_cuts_exactly(loaded_f32: Any) -> None:
    prompt = encode(loaded_f32, "The capital of France is")
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    full = run(make_engine(loaded_f32), {"g": (prompt, greedy)})["g"].outputs[0]
    tok = loaded_f32.tokenizer
    # Find an output token of >= 3 characters and build a stop string that starts in the
    # previous token and ends inside this one.
    pieces = [tok.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    j = next(i for i in range(2, len(pieces)) if len(pieces[i]) - len(pieces[i - 1]) >= 3)
    boundary = len(pieces[j - 1])
    stop = full.text[boundary - 2 : boundary + 2]
    assert stop and full.text.find(stop) == boundary - 2, "pick a stop string that occurs once"
    for include in (False, True):
        params = SamplingParams(
            max_tokens=24, temperature=0.0, stop=[stop], include_stop_str_in_output=include
        )
        out = run(make_engine(loaded_f32), {"s": (prompt, params)})["s"].outputs[0]
        end = boundary - 2 + (len(stop) if include else 0)
        assert out.text == full.text[:end]
        assert out.finish_reason == "stop"
        assert out.stop_reason == stop
        assert out.token_ids == full.token_ids[: j + 1]  # stopped at the token completing it


def test_streamed_multibyte_text_has_no_replacement_characters(loaded_f32: Any) -> None:
    requests = {
        "emoji": (
            chat_ids(loaded_f32, "Reply only with emojis: happy birthday"),
            SamplingParams(max_tokens=24, temperature=0.0),
        ),
        "chinese": (
            chat_ids(loaded_f32, "请用中文介绍一下你自己。"),
            SamplingParams(max_tokens=24, temperature=0.0),
        ),
    }
    stream: dict[str, list[RequestOutput]] = {}
    final = run(make_engine(loaded_f32), requests, stream)
    for request_id, outs in stream.items():
        deltas, seen = [], ""
        for out in outs:
            text = out.outputs[0].text
            assert text.startswith(seen), "streamed text never changes what was sent"
            deltas.append(text[len(seen) :])
            seen = text
        full = final[request_id].outputs[0].text
        assert "".join(deltas) == full
        assert "\ufffd" not in full
        assert any(ord(c) > 0x2E80 for c in full), f"no multi-byte output to test: {full!r}"
        # Equal to a one-shot decode, except that a character cut off by max_tokens is left
        # out rather than shown as U+FFFD.
        one_shot = loaded_f32.tokenizer.decode(
            final[request_id].outputs[0].token_ids, skip_special_tokens=True
        )
        assert full == one_shot.rstrip("\ufffd")


def test_n_completions_share_the_prompt_blocks(loaded_f32: Any) -> None:
    prompt = encode(loaded_f32, "Here is a list of colours: " + "red, green, blue, " * 12)
    assert len(prompt) > 64
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=10)
    engine = make_engine(loaded_f32)
    out = run(engine, {"n": (prompt, params)})["n"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
    prefill = sum(s.num_prefill_tokens for s in engine.telemetry)
    # Completions 1 and 2 reuse the prompt's full blocks: each recomputes at most one block
    # (a prefix-cache hit never covers the last prompt token).
    assert prefill <= len(prompt) + 2 * 16
    for i, completion in enumerate(out.outputs):
        single = SamplingParams(max_tokens=8, temperature=1.0, seed=10 + i)
        alone = run(make_engine(loaded_f32), {"a": (prompt, single)})["a"].outputs[0]
        assert completion.token_ids == alone.token_ids


def test_logprobs_with_top_alternatives(loaded_f32: Any) -> None:
    prompt = encode(loaded_f32, "1, 2, 3, 4,")
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
    out = run(make_engine(loaded_f32), {"l": (prompt, params)})["l"].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token
        assert len(lp.top) == 3
        assert lp.top[0][0] == token  # greedy picks the most likely token
        assert lp.logprob == lp.top[0][1] <= 0.0
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_min_tokens_and_stop_token_ids(loaded_f32: Any) -> None:
    prompt = chat_ids(loaded_f32, "What is 2+2? Answer with a number only.")
    short = run(
        make_engine(loaded_f32), {"a": (prompt, SamplingParams(max_tokens=40, temperature=0.0))}
    )
    natural = short["a"].outputs[0].token_ids
    assert natural[-1] in loaded_f32.eos_token_ids  # it stops by itself...
    params = SamplingParams(max_tokens=40, temperature=0.0, min_tokens=len(natural) + 3)
    longer = run(make_engine(loaded_f32), {"b": (prompt, params)})["b"].outputs[0]
    assert len(longer.token_ids) >= len(natural) + 3  # ...but not before min_tokens
    assert not set(longer.token_ids[: len(natural) + 2]) & loaded_f32.eos_token_ids
    stop_id = natural[1]
    params = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop_id])
    stopped = run(make_engine(loaded_f32), {"c": (prompt, params)})["c"].outputs[0]
    assert stopped.token_ids == natural[:2]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop_id)


def test_skip_special_tokens(loaded_f32: Any) -> None:
    prompt = chat_ids(loaded_f32, "What is 2+2? Answer with a number only.")
    texts = {}
    for skip in (True, False):
        params = SamplingParams(max_tokens=20, temperature=0.0, skip_special_tokens=skip)
        out = run(make_engine(loaded_f32), {"k": (prompt, params)})["k"].outputs[0]
        assert out.token_ids[-1] in loaded_f32.eos_token_ids
        texts[skip] = out.text
    eos_text = loaded_f32.tokenizer.decode([2])
    assert texts[False] == texts[True] + eos_text


def test_stop_strings_before_min_tokens_leave_the_text_intact(loaded_f32: Any) -> None:
    prompt = encode(loaded_f32, "The capital of France is")
    plain = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    full = run(make_engine(loaded_f32), {"p": (prompt, plain)})["p"].outputs[0].text
    assert full.startswith(" Paris")
    params = SamplingParams(
        max_tokens=20, temperature=0.0, ignore_eos=True, stop=["Par"], min_tokens=10
    )
    stream: dict[str, list[RequestOutput]] = {}
    out = run(make_engine(loaded_f32), {"s": (prompt, params)}, stream)["s"].outputs[0]
    assert out.text == full  # "Par" came before min_tokens: ignored, nothing cut
    assert out.finish_reason == "length"
    seen = ""
    for step in stream["s"]:
        assert step.outputs[0].text.startswith(seen)
        seen = step.outputs[0].text
