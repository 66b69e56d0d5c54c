"""Raw HTTP against a real server: SSE framing, disconnects, bad input, metrics, /load."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from server_utils import API_KEY, Server

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def load(server: Server) -> dict[str, Any]:
    return httpx.get(server.url + "/load", timeout=10).json()  # type: ignore[no-any-return]


def wait_all_blocks_free(server: Server, within_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + within_s
    while True:
        state = load(server)
        if state["num_free_blocks"] == state["num_total_blocks"] and state["num_running"] == 0:
            return state
        assert time.monotonic() < deadline, f"blocks still held: {state}"
        time.sleep(0.05)


def metric(server: Server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert values, f"{name} not exported"
    return values[0]


def test_sse_framing_bytewise(server: Server) -> None:
    body = {"prompt": "Hello, my name is", "max_tokens": 8, "stream": True, "temperature": 0}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"].startswith("cmpl-")
        raw = b"".join(r.iter_bytes())
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    events = events[:-1]
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {r.headers["x-request-id"]}
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert sum(c["choices"][0]["finish_reason"] is not None for c in chunks) == 1
    assert all("usage" not in c for c in chunks)  # only with stream_options.include_usage


@pytest.mark.parametrize(
    "content", ["Reply only with emojis: happy birthday", "请用中文介绍一下你自己。"]
)
def test_multibyte_stream_has_no_replacement_character(server: Server, content: str) -> None:
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
    }
    deltas = []
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    deltas.append(choice["delta"].get("content", ""))
    text = "".join(deltas)
    full = httpx.post(
        server.url + "/v1/chat/completions",
        json={**body, "stream": False},
        headers=AUTH,
        timeout=60,
    ).json()["choices"][0]["message"]["content"]
    assert text == full and "\ufffd" not in text
    assert any(ord(c) > 0x2E80 for c in text), text


def test_streaming_disconnect_frees_blocks_within_a_second(server: Server) -> None:
    body = {
        "prompt": "Tell me a long story.",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60
    ) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert load(server)["num_running"] == 1
    wait_all_blocks_free(server, within_s=1.0)


def test_non_streaming_disconnect_frees_blocks_within_a_second(server: Server) -> None:
    body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True}

    async def go() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            task = asyncio.create_task(
                http.post(server.url + "/v1/completions", json=body, headers=AUTH)
            )
            deadline = time.monotonic() + 30
            while (await http.get(server.url + "/load")).json()["num_running"] == 0:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    wait_all_blocks_free(server, within_s=1.0)


MSG = [{"role": "user", "content": "x"}]
TOOL = {"type": "function", "function": {"name": "f"}}
CHAT = "/v1/chat/completions"
JSON_MODE = {"type": "json_object"}
IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
BAD_REQUESTS: list[tuple[str, str, Any, int]] = [
    ("/v1/completions", "empty prompt", {"prompt": ""}, 400),
    ("/v1/completions", "empty list", {"prompt": []}, 400),
    ("/v1/completions", "list of empty", {"prompt": [""]}, 400),
    ("/v1/completions", "prompt over max_model_len", {"prompt": [1] * 9000}, 400),
    ("/v1/completions", "prompt + max_tokens over", {"prompt": "hi", "max_tokens": 8192}, 400),
    ("/v1/completions", "prompt over the KV pool", {"prompt": [1] * 5000, "max_tokens": 1}, 400),
    ("/v1/completions", "negative max_tokens", {"prompt": "hi", "max_tokens": -5}, 400),
    ("/v1/completions", "huge max_tokens", {"prompt": "hi", "max_tokens": 10**30}, 400),
    ("/v1/completions", "temperature", {"prompt": "hi", "temperature": 101}, 400),
    ("/v1/completions", "top_p", {"prompt": "hi", "top_p": 0}, 400),
    ("/v1/completions", "top_k", {"prompt": "hi", "top_k": -2}, 400),
    ("/v1/completions", "min_p", {"prompt": "hi", "min_p": 1.5}, 400),
    ("/v1/completions", "presence", {"prompt": "hi", "presence_penalty": 3}, 400),
    ("/v1/completions", "frequency", {"prompt": "hi", "frequency_penalty": -3}, 400),
    ("/v1/completions", "repetition", {"prompt": "hi", "repetition_penalty": 0}, 400),
    ("/v1/completions", "n zero", {"prompt": "hi", "n": 0}, 400),
    ("/v1/completions", "logprobs over limit", {"prompt": "hi", "logprobs": 6}, 400),
    (CHAT, "top_logprobs", {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400),
    ("/v1/completions", "unknown model", {"prompt": "hi", "model": "nope"}, 404),
    ("/v1/completions", "wrong type", {"prompt": "hi", "max_tokens": "many"}, 400),
    ("/v1/completions", "wrong prompt type", {"prompt": {"a": 1}}, 400),
    ("/v1/completions", "token id out of vocab", {"prompt": [10**9]}, 400),
    ("/v1/completions", "unknown tier", {"prompt": "hi", "priority": "gold"}, 400),
    ("/v1/completions", "bad seed", {"prompt": "hi", "seed": 2**70}, 400),
    ("/v1/completions", "malformed JSON", b'{"prompt": "hi",', 400),
    ("/v1/completions", "not an object", b"[1, 2]", 400),
    ("/v1/completions", "oversized body", {"prompt": "x" * (5 << 20)}, 413),
    ("/v1/chat/completions", "no messages", {"messages": []}, 400),
    ("/v1/chat/completions", "bad role", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("/v1/chat/completions", "tools", {"messages": MSG, "tools": [TOOL]}, 400),
    (CHAT, "json mode", {"messages": MSG, "response_format": JSON_MODE}, 400),
    ("/v1/chat/completions", "image part", {"messages": IMAGE}, 400),
    ("/v1/completions", "logit_bias", {"prompt": "hi", "logit_bias": {"1": 5}}, 400),
    ("/v1/completions", "stream_options alone", {"prompt": "hi", "stream_options": {}}, 400),
    ("/v1/completions", "top_k over int64", {"prompt": "hi", "top_k": 2**63}, 400),
    ("/v1/completions", "lone surrogate", b'{"prompt": "\\ud800"}', 400),
    (CHAT, "surrogate in chat", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400),
    ("/tokenize", "lone surrogate", b'{"prompt": "\\ud800"}', 400),
    ("/v1/completions", "boolean n", {"prompt": "hi", "n": True}, 400),
    ("/v1/completions", "batch x n too large", {"prompt": [[1, 2]] * 100, "n": 8}, 400),
    (CHAT, "bad max_tokens", {"messages": MSG, "max_tokens": -1, "max_completion_tokens": 5}, 400),
    ("/tokenize", "neither prompt nor messages", {}, 400),
    ("/detokenize", "token out of vocab", {"tokens": [-1]}, 400),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "what", "body", "status"), BAD_REQUESTS, ids=[b[1] for b in BAD_REQUESTS]
)
def test_bad_input_is_a_clear_4xx(
    server: Server, path: str, what: str, body: Any, status: int
) -> None:
    kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {**AUTH, "content-type": "application/json"}
    r = httpx.post(server.url + path, headers=headers, timeout=60, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_server_serves_normally_after_bad_input(server: Server) -> None:
    for path, _, body, _ in BAD_REQUESTS[:8]:
        httpx.post(server.url + path, json=body, headers=AUTH, timeout=60)
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 4},
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(server.url + "/health").status_code == 200
    assert metric(server, 'iterserve_requests_rejected_total{reason="invalid"}') >= 8


def test_operational_endpoints_need_no_key(server: Server) -> None:
    for path in ("/health", "/ready", "/load", "/metrics"):
        assert httpx.get(server.url + path).status_code == 200
    assert httpx.get(server.url + "/version").status_code == 401
    assert httpx.get(server.url + "/version", headers=AUTH).json()["version"]


def test_tokenize_round_trip(server: Server) -> None:
    tokens = httpx.post(
        server.url + "/tokenize", json={"prompt": "Hello world"}, headers=AUTH
    ).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(
        server.url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=AUTH
    ).json()["prompt"]
    assert text == "Hello world"
    chat = httpx.post(
        server.url + "/tokenize",
        json={"messages": [{"role": "user", "content": "Hi"}]},
        headers=AUTH,
    ).json()
    assert chat["count"] > tokens["count"]


def test_load_and_metrics_report_requests(server: Server) -> None:
    before = metric(server, 'iterserve_request_success_total{finished_reason="length"}')
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "Hi there", "max_tokens": 5, "ignore_eos": True, "priority": "premium"},
        headers={**AUTH, "X-Request-Id": "my-request-7"},
        timeout=60,
    )
    assert r.headers["x-request-id"].startswith("cmpl-")
    assert metric(server, 'iterserve_request_success_total{finished_reason="length"}') == before + 1
    assert metric(server, 'iterserve_time_to_first_token_seconds_count{tier="premium"}') >= 1
    assert (
        metric(server, 'iterserve_request_time_per_output_token_seconds_count{tier="premium"}') >= 1
    )
    assert metric(server, 'iterserve_request_queue_time_seconds_count{tier="premium"}') >= 1
    assert metric(server, "iterserve_inter_token_latency_seconds_count") >= 4
    assert metric(server, "iterserve_iteration_latency_seconds_count") >= 5
    assert metric(server, 'iterserve_iteration_tokens_count{phase="decode"}') >= 4
    assert metric(server, "iterserve_generation_tokens_total") >= 5
    assert metric(server, "iterserve_prompt_tokens_total") >= 2
    assert metric(server, "iterserve_prefix_cache_queries_total") >= 2
    state = load(server)
    assert set(state) == {
        "kv_cache_usage", "num_running", "num_waiting", "num_swapped", "max_num_seqs",
        "num_free_blocks", "num_cached_blocks", "num_total_blocks", "config_version",
        "config_hash",
    }  # fmt: skip
    assert state["num_total_blocks"] == 256
    assert metric(server, "iterserve_kv_cache_usage_ratio") == pytest.approx(
        state["kv_cache_usage"]
    )


def test_oversized_chunked_body_is_413(server: Server) -> None:
    def body() -> Any:
        yield b'{"prompt": "'
        for _ in range(6):
            yield b"x" * (1 << 20)
        yield b'"}'

    r = httpx.post(
        server.url + "/v1/completions",
        content=body(),
        headers={**AUTH, "content-type": "application/json"},
        timeout=60,
    )
    assert "content-length" not in r.request.headers
    assert r.status_code == 413, r.text
    assert r.json()["error"]["message"].startswith("the request body is larger than")


def test_a_bad_key_is_401_before_the_body_is_parsed(server: Server) -> None:
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": ', timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_completion_defaults_and_echo_of_token_prompts(server: Server) -> None:
    body = {"prompt": "Once", "max_tokens": None, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60).json()
    assert r["usage"]["completion_tokens"] == 16  # OpenAI's default, not the whole context
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "Hello there"}, headers=AUTH)
    body = {"prompt": ids.json()["tokens"], "max_tokens": 3, "echo": True}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60).json()
    assert r["choices"][0]["text"].startswith("Hello there")


def test_streamed_text_offsets_continue_across_chunks(server: Server) -> None:
    body = {"prompt": "Count: 1, 2,", "max_tokens": 6, "logprobs": 1, "stream": True}
    tokens, offsets = [], []
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    tokens += choice["logprobs"]["tokens"]
                    offsets += choice["logprobs"]["text_offset"]
    assert len(tokens) == 6
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(6)]
