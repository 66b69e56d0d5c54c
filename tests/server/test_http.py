"""The HTTP layer over a fake engine (no model, milliseconds a test): SSE framing, choices and
their order, logprobs, echo, disconnects (streaming, not, and while queued), bad input with
OpenAI's error shape, auth, body limits, /load, /metrics and engine failures.

The fake (tests/fake_engine.py) knows every answer, so texts are checked exactly.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from fake_engine import (
    BLOCK_SIZE,
    NUM_KV_BLOCKS,
    FakeClock,
    FakeEngineClient,
    expected_text,
    fake_logprob,
    fake_token,
    run_with_server,
    until,
)

from iterserve.config import SchedulerConfig, ServerConfig

API_KEY = "sk-fake"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": "Bearer admin"}
CONFIG = ServerConfig(api_key=API_KEY)


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text).input_ids)


async def metric(http: httpx.AsyncClient, name: str, missing: float | None = None) -> float:
    """The sample ``name`` (with labels); ``missing`` if given and the series has none yet."""
    text = (await http.get("/metrics")).text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    if not values and missing is not None:
        return missing
    assert values, f"{name} not exported"
    return values[0]


async def sse_events(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[bytes]:
    async with http.stream("POST", path, json={**body, "stream": True}, headers=AUTH) as r:
        assert r.status_code == 200, await r.aread()
        raw = b"".join([chunk async for chunk in r.aiter_bytes()])
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events[:-1])
    return [e[6:] for e in events[:-2]]  # without [DONE]


def test_sse_framing_and_text_are_exact(tokenizer: Any) -> None:
    ids = prompt_ids(tokenizer, "Hello, my name is")

    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        body = {"prompt": "Hello, my name is", "max_tokens": 8}
        events = await sse_events(http, "/v1/completions", body)
        chunks = [json.loads(e) for e in events]
        assert len(chunks) == 8 and len({c["id"] for c in chunks}) == 1
        assert chunks[0]["id"].startswith("cmpl-")
        texts = [c["choices"][0]["text"] for c in chunks]
        assert texts == [tokenizer.decode([fake_token(ids, 0, k)]) for k in range(8)]
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 7 + ["length"]
        assert all("usage" not in c for c in chunks)  # only with stream_options.include_usage
        full = (await http.post("/v1/completions", json=body, headers=AUTH)).json()
        assert full["choices"][0]["text"] == "".join(texts) == expected_text(tokenizer, ids, 0, 8)
        assert full["usage"] == {
            "prompt_tokens": len(ids),
            "completion_tokens": 8,
            "total_tokens": len(ids) + 8,
            "prompt_tokens_details": {"cached_tokens": 0},
        }

    run_with_server(tokenizer, check, CONFIG)


def test_chat_stream_opens_with_the_role_and_ends_with_usage(tokenizer: Any) -> None:
    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        body = {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3,
            "n": 2,
            "stream_options": {"include_usage": True},
        }
        chunks = [json.loads(e) for e in await sse_events(http, "/v1/chat/completions", body)]
        assert chunks[0]["choices"] == [
            {"index": i, "delta": {"role": "assistant", "content": ""}}
            | {"logprobs": None, "finish_reason": None, "stop_reason": None}
            for i in range(2)
        ]
        ids = fake.added[0].prompt_token_ids
        for index in range(2):
            text = "".join(
                ch["delta"].get("content", "")
                for c in chunks[1:]
                for ch in c["choices"]
                if ch["index"] == index
            )
            assert text == expected_text(tokenizer, ids, index, 3)
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == 6
        assert all(c["usage"] is None for c in chunks[:-1])  # OpenAI's shape with include_usage
        del body["stream_options"]
        full = (await http.post("/v1/chat/completions", json=body, headers=AUTH)).json()
        assert [c["message"]["content"] for c in full["choices"]] == [
            expected_text(tokenizer, ids, i, 3) for i in range(2)
        ]

    run_with_server(tokenizer, check, CONFIG)


def test_batch_prompts_and_n_fill_choices_in_order_with_echo(tokenizer: Any) -> None:
    prompts = ["One", "Two three"]

    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        body = {"prompt": prompts, "n": 2, "max_tokens": 2, "echo": True}
        r = (await http.post("/v1/completions", json=body, headers=AUTH)).json()
        texts = [c["text"] for c in r["choices"]]
        assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
        assert texts == [
            p + expected_text(tokenizer, prompt_ids(tokenizer, p), i, 2)
            for p in prompts
            for i in range(2)
        ]
        assert len(fake.added) == 2 and all(a.params.n == 2 for a in fake.added)
        # Token prompts echo their decoded text.
        ids = prompt_ids(tokenizer, "Hello there")
        body = {"prompt": ids, "max_tokens": 3, "echo": True}
        r = (await http.post("/v1/completions", json=body, headers=AUTH)).json()
        assert r["choices"][0]["text"] == "Hello there" + expected_text(tokenizer, ids, 0, 3)

    run_with_server(tokenizer, check, CONFIG)


def test_streamed_logprobs_and_text_offsets_continue_across_chunks(tokenizer: Any) -> None:
    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        body = {"prompt": "Count: 1, 2,", "max_tokens": 6, "logprobs": 1}
        events = await sse_events(http, "/v1/completions", body)
        choices = [json.loads(e)["choices"][0] for e in events]
        tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
        offsets = [o for c in choices for o in c["logprobs"]["text_offset"]]
        logprobs = [lp for c in choices for lp in c["logprobs"]["token_logprobs"]]
        assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(6)]
        assert logprobs == [fake_logprob(k) for k in range(6)]
        full = (await http.post("/v1/completions", json=body, headers=AUTH)).json()
        assert full["choices"][0]["logprobs"]["text_offset"] == offsets
        assert full["choices"][0]["logprobs"]["tokens"] == tokens

    run_with_server(tokenizer, check, CONFIG)


def test_completion_max_tokens_defaults_to_16_and_chat_to_the_rest(tokenizer: Any) -> None:
    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        body = {"prompt": "Once", "max_tokens": None}
        r = (await http.post("/v1/completions", json=body, headers=AUTH)).json()
        assert r["usage"]["completion_tokens"] == 16  # OpenAI's default
        chat = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
        async with http.stream("POST", "/v1/chat/completions", json=chat, headers=AUTH) as s:
            assert s.status_code == 200
        added = fake.added[-1]
        assert added.params.max_tokens == fake.limits.max_model_len - len(added.prompt_token_ids)

    run_with_server(tokenizer, check, CONFIG)


def test_a_streaming_disconnect_aborts_and_frees_the_blocks(tokenizer: Any) -> None:
    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        body = {"prompt": "Tell me a long story.", "max_tokens": 400, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
            lines = r.aiter_lines()
            for _ in range(3):
                await anext(lines)
            load = (await http.get("/load")).json()
            assert load["num_running"] == 1 and load["num_free_blocks"] < NUM_KV_BLOCKS
        await until(lambda: fake.num_live == 0, "the request was not aborted")
        assert fake.aborted == [fake.added[0].request_id]
        load = (await http.get("/load")).json()
        assert load["num_running"] == 0 and load["num_free_blocks"] == NUM_KV_BLOCKS
        assert await metric(http, 'iterserve_request_success_total{finished_reason="abort"}') == 1

    run_with_server(tokenizer, check, CONFIG, step_interval_s=0.005)


def test_a_non_streaming_disconnect_aborts(tokenizer: Any) -> None:
    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        body = {"prompt": "Tell me a long story.", "max_tokens": 400}
        task = asyncio.create_task(http.post("/v1/completions", json=body, headers=AUTH))
        await until(lambda: fake.load.num_running == 1, "never admitted")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: fake.num_live == 0, "the request was not aborted")
        assert fake.aborted == [fake.added[0].request_id]

    run_with_server(tokenizer, check, CONFIG, step_interval_s=0.005)


def test_a_client_that_leaves_while_queued_is_aborted_and_leaves_the_queue(tokenizer: Any) -> None:
    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        body = {"prompt": "Wait for me", "max_tokens": 4, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            assert (await http.get("/load")).json()["num_waiting"] == 1  # never admitted
        await until(lambda: fake.num_live == 0, "the queued request was not aborted")
        assert fake.aborted == [fake.added[0].request_id]
        assert (await http.get("/load")).json()["num_waiting"] == 0
        # It no longer holds a place in the queue: with max_waiting=1 the next one is accepted.
        fake.max_running = 32
        task = asyncio.create_task(
            http.post("/v1/completions", json={**body, "stream": False}, headers=AUTH)
        )
        await until(lambda: fake.num_live == 1, "the next request was not queued")
        for _ in range(4):
            fake.step()
        assert (await task).status_code == 200

    scheduler = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, max_waiting=1)
    fake = run_with_server(
        tokenizer, check, CONFIG, auto_step=False, max_running=0, scheduler=scheduler
    )
    assert len(fake.added) == 2


MSG = [{"role": "user", "content": "x"}]
TOOL = {"type": "function", "function": {"name": "f"}}
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
JSON_MODE = {"type": "json_object"}
IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
# (path, what, body, status, param); the fake engine: max_model_len 1024, 32 blocks of 16.
BAD_REQUESTS: list[tuple[str, str, Any, int, str | None]] = [
    (CMPL, "empty prompt", {"prompt": ""}, 400, "prompt"),
    (CMPL, "empty list", {"prompt": []}, 400, "prompt"),
    (CMPL, "list of empty", {"prompt": [""]}, 400, "prompt"),
    (CMPL, "prompt over max_model_len", {"prompt": [1] * 2000}, 400, "prompt"),
    (CMPL, "prompt + max_tokens over", {"prompt": "hi", "max_tokens": 2000}, 400, "max_tokens"),
    (CMPL, "prompt over the KV pool", {"prompt": [1] * 600, "max_tokens": 1}, 400, "prompt"),
    (CMPL, "negative max_tokens", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    (CMPL, "huge max_tokens", {"prompt": "hi", "max_tokens": 10**30}, 400, "max_tokens"),
    (CMPL, "temperature", {"prompt": "hi", "temperature": 101}, 400, "temperature"),
    (CMPL, "top_p", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (CMPL, "top_k", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    (CMPL, "min_p", {"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    (CMPL, "presence", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    (CMPL, "frequency", {"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    (CMPL, "repetition", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (CMPL, "n zero", {"prompt": "hi", "n": 0}, 400, "n"),
    (CMPL, "logprobs over limit", {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    (CHAT, "top_logprobs", {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    (CMPL, "unknown model", {"prompt": "hi", "model": "nope"}, 404, "model"),
    (CMPL, "wrong type", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    (CMPL, "wrong prompt type", {"prompt": {"a": 1}}, 400, "prompt"),
    (CMPL, "token id out of vocab", {"prompt": [10**9]}, 400, "prompt"),
    (CMPL, "unknown tier", {"prompt": "hi", "priority": "gold"}, 400, "priority"),
    # bounded to (-2**53, 2**53), so that admission's float wait estimate cannot overflow
    (CMPL, "huge priority", {"prompt": "hi", "priority": 10**400}, 400, "priority"),
    (CMPL, "huge negative priority", {"prompt": "hi", "priority": -(2**53)}, 400, "priority"),
    (CMPL, "bad seed", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    (CMPL, "malformed JSON", b'{"prompt": "hi",', 400, None),
    (CMPL, "not an object", b"[1, 2]", 400, None),
    (CMPL, "oversized body", {"prompt": "x" * (5 << 20)}, 413, None),
    (CHAT, "no messages", {"messages": []}, 400, "messages"),
    (CHAT, "no content", {"messages": [{"role": "user"}]}, 400, "messages"),
    (CHAT, "null content", {"messages": [{"role": "user", "content": None}]}, 400, "messages"),
    (CHAT, "bad role", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    (CHAT, "tools", {"messages": MSG, "tools": [TOOL]}, 400, "tools"),
    (CHAT, "json mode", {"messages": MSG, "response_format": JSON_MODE}, 400, "response_format"),
    (CHAT, "image part", {"messages": IMAGE}, 400, "messages"),
    (CMPL, "logit_bias", {"prompt": "hi", "logit_bias": {"1": 5}}, 400, "logit_bias"),
    (CMPL, "stream_options alone", {"prompt": "hi", "stream_options": {}}, 400, "stream_options"),
    (CMPL, "echo with logprobs", {"prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo"),
    (CMPL, "top_k over int64", {"prompt": "hi", "top_k": 2**63}, 400, "top_k"),
    (CMPL, "lone surrogate", b'{"prompt": "\\ud800"}', 400, "prompt"),
    (CHAT, "surrogate in chat", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "messages"),
    ("/tokenize", "lone surrogate", b'{"prompt": "\\ud800"}', 400, "prompt"),
    (CMPL, "boolean n", {"prompt": "hi", "n": True}, 400, "n"),
    (CMPL, "string boolean", {"prompt": "hi", "ignore_eos": "yes"}, 400, "ignore_eos"),
    (CMPL, "integer boolean", {"prompt": "hi", "echo": 1}, 400, "echo"),
    (CMPL, "n out of range in a batch", {"prompt": ["a", "b"], "n": 10**30}, 400, "n"),
    (CHAT, "text part without text", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": 5}]}]}, 400, "messages"),
    (CMPL, "batch x n too large", {"prompt": [[1, 2]] * 100, "n": 8}, 400, "prompt"),
    (CHAT, "bad max_tokens", {"messages": MSG, "max_tokens": -1, "max_completion_tokens": 5}, 400,
     "max_tokens"),
    ("/tokenize", "neither prompt nor messages", {}, 400, "prompt"),
    ("/tokenize", "no messages", {"messages": []}, 400, "messages"),
    ("/v1/completions", "too many prompts", {"prompt": ["a"] * 257}, 400, "prompt"),
    ("/v1/completions", "prompts x n", {"prompt": ["a"] * 129, "n": 2}, 400, "prompt"),
    ("/detokenize", "token out of vocab", {"tokens": [-1]}, 400, "tokens"),
]  # fmt: skip


async def post_bad(http: httpx.AsyncClient, path: str, body: Any) -> httpx.Response:
    kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {**AUTH, "content-type": "application/json"}
    return await http.post(path, headers=headers, **kwargs)


def test_bad_input_is_a_clear_4xx_in_openais_shape_and_loses_nothing(tokenizer: Any) -> None:
    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        before = await metric(http, 'iterserve_requests_rejected_total{reason="invalid"}')
        for path, what, body, status, param in BAD_REQUESTS:
            r = await post_bad(http, path, body)
            assert r.status_code == status, (what, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], what
            assert error["type"] == "invalid_request_error", (what, error)
            assert error["param"] == param, (what, error)
        rejected = await metric(http, 'iterserve_requests_rejected_total{reason="invalid"}')
        assert rejected - before == len(BAD_REQUESTS)
        assert fake.added == []  # nothing reached the engine
        r = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, headers=AUTH)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert (await http.get("/health")).status_code == 200

    run_with_server(tokenizer, check, CONFIG)


def test_auth_operational_endpoints_and_body_limits(tokenizer: Any) -> None:
    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        for path in ("/health", "/ready", "/load", "/metrics"):
            assert (await http.get(path)).status_code == 200
        assert (await http.get("/version")).status_code == 401
        assert (await http.get("/version", headers=AUTH)).json()["version"]
        lower = {"Authorization": AUTH["Authorization"].replace("Bearer", "bearer")}
        assert (await http.get("/version", headers=lower)).status_code == 200  # RFC 9110
        for wrong in ("Basic " + API_KEY, API_KEY, "Bearer", "Bearer " + API_KEY + "x"):
            r = await http.get("/version", headers={"Authorization": wrong})
            assert r.status_code == 401, wrong
        r = await http.post("/v1/completions", content=b'{"prompt": ')  # no key, broken body
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.json()["error"]["code"] == "invalid_api_key"

        async def body() -> Any:
            yield b'{"prompt": "'
            for _ in range(6):
                yield b"x" * (1 << 20)
            yield b'"}'

        headers = {**AUTH, "content-type": "application/json"}
        r = await http.post("/v1/completions", content=body(), headers=headers)
        assert "content-length" not in r.request.headers
        assert r.status_code == 413, r.text
        assert r.json()["error"]["message"] == "the request body is larger than 4194304 bytes"
        assert fake.added == []

    run_with_server(tokenizer, check, CONFIG)


def test_tokenize_round_trip(tokenizer: Any) -> None:
    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        r = (await http.post("/tokenize", json={"prompt": "Hello world"}, headers=AUTH)).json()
        ids = prompt_ids(tokenizer, "Hello world")
        assert r == {"count": 2, "max_model_len": 1024, "tokens": ids}
        back = await http.post("/detokenize", json={"tokens": r["tokens"]}, headers=AUTH)
        assert back.json() == {"prompt": "Hello world"}
        messages = [{"role": "user", "content": "Hi"}]
        chat = (await http.post("/tokenize", json={"messages": messages}, headers=AUTH)).json()
        templated = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert chat["tokens"] == list(tokenizer(templated, add_special_tokens=False).input_ids)

    run_with_server(tokenizer, check, CONFIG)


def test_load_and_metrics_change_by_exactly_one_request(tokenizer: Any) -> None:
    names = {
        "success": 'iterserve_request_success_total{finished_reason="length"}',
        "ttft": 'iterserve_time_to_first_token_seconds_count{tier="premium"}',
        "tpot": 'iterserve_request_time_per_output_token_seconds_count{tier="premium"}',
        "queue": 'iterserve_request_queue_time_seconds_count{tier="premium"}',
        "e2e": 'iterserve_e2e_request_latency_seconds_count{tier="premium"}',
        "itl": "iterserve_inter_token_latency_seconds_count",
        "iterations": "iterserve_iteration_latency_seconds_count",
        "decode": 'iterserve_iteration_tokens_count{phase="decode"}',
        "generated": "iterserve_generation_tokens_total",
    }

    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        before = {k: await metric(http, name, missing=0.0) for k, name in names.items()}
        body = {"prompt": "Hi there", "max_tokens": 5, "priority": "premium"}
        r = await http.post("/v1/completions", json=body, headers={**AUTH, "X-Request-Id": "x"})
        assert r.status_code == 200 and r.headers["x-request-id"].startswith("cmpl-")
        after = {k: await metric(http, name) for k, name in names.items()}
        change = {k: after[k] - before[k] for k in names}
        assert change == {
            "success": 1, "ttft": 1, "tpot": 1, "queue": 1, "e2e": 1, "itl": 4,
            "iterations": 5, "decode": 5, "generated": 5,
        }  # fmt: skip
        load = (await http.get("/load")).json()
        assert load == {
            "kv_cache_usage": 0.0, "num_running": 0, "num_waiting": 0, "num_swapped": 0,
            "max_num_seqs": 32, "num_free_blocks": NUM_KV_BLOCKS, "num_cached_blocks": 0,
            "num_total_blocks": NUM_KV_BLOCKS, "config_version": 1,
            "config_hash": load["config_hash"], "draining": False,
        }  # fmt: skip
        # While a request runs, /load and the gauges show its blocks (the same numbers).
        fake.auto_step = False
        long_body = {"prompt": [1] * 40, "max_tokens": 100, "stream": True}
        async with http.stream("POST", "/v1/completions", json=long_body, headers=AUTH) as s:
            assert s.status_code == 200
            fake.step()
            load = (await http.get("/load")).json()
            assert load["num_running"] == 1 and load["num_free_blocks"] == NUM_KV_BLOCKS - 3
            assert (
                load["kv_cache_usage"]
                == 3 / NUM_KV_BLOCKS
                == pytest.approx(await metric(http, "iterserve_kv_cache_usage_ratio"))
            )
            assert await metric(http, "iterserve_num_requests_running") == 1
            # The Gateway API inference protocol's names (vLLM's) carry the same numbers.
            text = (await http.get("/metrics")).text
            samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line[:1] not in "#")
            for ours, theirs in [
                ("iterserve_num_requests_running", "vllm:num_requests_running"),
                ("iterserve_num_requests_waiting", "vllm:num_requests_waiting"),
                ("iterserve_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc"),
            ]:
                assert samples[ours] == samples[theirs]
            labels = f'block_size="{BLOCK_SIZE}",num_gpu_blocks="{NUM_KV_BLOCKS}"'
            assert float(samples["vllm:cache_config_info{" + labels + "}"]) == 1
        assert BLOCK_SIZE == 16  # 41 tokens: 3 blocks

    run_with_server(tokenizer, check, CONFIG, step_interval_s=0.001)


@pytest.mark.parametrize(
    ("priority", "queued_as", "tier"),
    [("premium", 0, "premium"), (None, 1, "standard"), (0, 0, "premium"), (7, 7, "best-effort"),
     ("best-effort", 2, "best-effort")],
)  # fmt: skip
def test_priority_by_name_or_integer_is_queued_and_labelled_by_its_tier(
    tokenizer: Any, priority: Any, queued_as: int, tier: str
) -> None:
    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        name = f'iterserve_e2e_request_latency_seconds_count{{tier="{tier}"}}'
        before = await metric(http, name, missing=0.0)
        body = {"prompt": "Hi", "max_tokens": 2, "priority": priority}
        assert (await http.post("/v1/completions", json=body, headers=AUTH)).status_code == 200
        assert [a.priority for a in fake.added] == [queued_as]
        assert await metric(http, name) == before + 1

    run_with_server(tokenizer, check, CONFIG)


def test_arrival_time_is_when_the_http_request_was_accepted(tokenizer: Any) -> None:
    clock = FakeClock(500.0)

    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        body = {"prompt": "Hi", "max_tokens": 3, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body, headers=AUTH) as s:
            assert s.status_code == 200
            clock.advance(2.5)  # it waits 2.5 s before the engine admits it
            for _ in range(3):
                fake.step()
            await s.aread()
        assert fake.added[0].arrival_time == 500.0
        queue = await metric(http, 'iterserve_request_queue_time_seconds_sum{tier="standard"}')
        ttft = await metric(http, 'iterserve_time_to_first_token_seconds_sum{tier="standard"}')
        assert queue == ttft == 2.5

    run_with_server(tokenizer, check, CONFIG, clock=clock, auto_step=False)


def test_a_failed_iteration_is_a_500_or_an_error_event_and_the_server_goes_on(
    tokenizer: Any,
) -> None:
    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        body = {"prompt": "Hi", "max_tokens": 3}
        fake.fail_next_step = True
        r = await http.post("/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "internal_error"
        assert "fake forward failed" in r.json()["error"]["message"]
        fake.fail_next_step = True
        events = await sse_events(http, "/v1/completions", body)
        assert json.loads(events[-1])["error"]["type"] == "internal_error"
        assert await metric(http, 'iterserve_request_success_total{finished_reason="error"}') == 2
        assert (await http.post("/v1/completions", json=body, headers=AUTH)).status_code == 200

    run_with_server(tokenizer, check, CONFIG)


def test_a_dead_engine_fails_health_and_requests_with_503(tokenizer: Any) -> None:
    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        body = {"prompt": "Hi", "max_tokens": 300}
        task = asyncio.create_task(http.post("/v1/completions", json=body, headers=AUTH))
        await until(lambda: fake.load.num_running == 1, "never admitted")
        fake.kill()
        r = await task
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
        for path in ("/health", "/ready", "/load"):  # a router must not pick it as idle
            assert (await http.get(path)).status_code == 503, path
        r = await http.post("/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["message"] == (
            "the engine is unavailable: the engine is not running"
        )
        # Streaming too: known before the response starts, so a 503 rather than a 200 stream.
        r = await http.post("/v1/completions", json={**body, "stream": True}, headers=AUTH)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
        r = await http.put("/admin/scheduler_config", json={"max_num_seqs": 8}, headers=ADMIN)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"

    server_config = ServerConfig(api_key=API_KEY, admin_token="admin")
    run_with_server(tokenizer, check, server_config, step_interval_s=0.005)


def test_too_many_prompts_are_refused_before_any_is_tokenized(tokenizer: Any) -> None:
    """A batch over the sequence limit costs no tokenizer time (a 100,000-prompt body would
    otherwise hold a core for seconds before its 400)."""
    encoded: list[Any] = []

    class CountingTokenizer:
        def __getattr__(self, name: str) -> Any:
            return getattr(tokenizer, name)

        def __len__(self) -> int:
            return len(tokenizer)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            encoded.append(args)
            return tokenizer(*args, **kwargs)

    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        r = await post_bad(http, CMPL, {"prompt": ["a"] * 300})
        assert r.status_code == 400 and "split the batch" in r.json()["error"]["message"]
        assert encoded == []
        r = await http.post(CMPL, json={"prompt": "Hi", "max_tokens": 2}, headers=AUTH)
        assert r.status_code == 200 and len(encoded) == 1

    run_with_server(CountingTokenizer(), check, CONFIG)
