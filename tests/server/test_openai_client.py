"""The official ``openai`` client against a real server on the real default model."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from server_utils import API_KEY, Server

MODEL = "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def stream_completion(
    client: openai.OpenAI, **kwargs: Any
) -> tuple[dict[int, str], Any, dict[int, list[str]]]:
    """Join a streamed completion: text per choice, the usage chunk, finish reasons per choice."""
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    usage = None
    for chunk in client.completions.create(
        model=MODEL, stream=True, stream_options={"include_usage": True}, **kwargs
    ):
        if chunk.usage is not None:
            assert not chunk.choices
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    return texts, usage, finishes


def test_models_lists_the_default_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion_streamed_equals_non_streamed(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"prompt": "The three primary colours are", "max_tokens": 24}
    full = client.completions.create(model=MODEL, temperature=0, **kwargs)
    texts, usage, finishes = stream_completion(client, temperature=0, **kwargs)
    assert full.choices[0].text and texts == {0: full.choices[0].text}
    assert finishes == {0: [full.choices[0].finish_reason]}
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


def test_chat_streamed_equals_non_streamed(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Name three fruits."}]
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=32, temperature=0
    )
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content
    text, roles, finishes, usage = "", [], [], None
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            text += choice.delta.content or ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert text == full.choices[0].message.content
    assert roles == ["assistant"] and finishes == [full.choices[0].finish_reason]
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_n_completions_with_seed(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "prompt": "Once upon a time",
        "max_tokens": 16,
        "temperature": 1.0,
        "n": 3,
        "seed": 1234,
    }
    texts, usage, finishes = stream_completion(client, **kwargs)
    assert sorted(texts) == [0, 1, 2]
    assert all(len(finishes[i]) == 1 for i in range(3)), finishes
    full = client.completions.create(model=MODEL, **kwargs)
    assert {c.index: c.text for c in full.choices} == texts  # seeded: reproducible
    assert len(set(texts.values())) > 1  # completion i uses seed + i
    again = client.completions.create(model=MODEL, **{**kwargs, "seed": 99})
    assert {c.index: c.text for c in again.choices} != texts
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=6, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == out.usage.completion_tokens
    assert "".join(lp.tokens) == out.choices[0].text
    for token, logprob, top in zip(
        lp.tokens, lp.token_logprobs or [], lp.top_logprobs, strict=True
    ):
        assert logprob <= 0 and len(top) == 2
        assert max(top.values()) >= logprob - 1e-4  # greedy: the sampled token is the best
        assert token in top


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == out.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-4
        assert bytes(entry.bytes or []) == entry.token.encode()


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "prompt": "The alphabet begins with",
        "max_tokens": 24,
        "temperature": 0,
    }
    full = client.completions.create(model=MODEL, **kwargs).choices[0].text
    assert len(full) > 12
    stop = full[8:11]
    cut = full.index(stop)
    out = client.completions.create(model=MODEL, stop=[stop], **kwargs).choices[0]
    assert out.text == full[:cut] and out.finish_reason == "stop"
    texts, _, finishes = stream_completion(client, stop=[stop], **kwargs)
    assert texts == {0: full[:cut]} and finishes == {0: ["stop"]}


def test_echo_and_batch_prompts(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt=["Hello", "The sky is"], max_tokens=4, temperature=0, echo=True
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text.startswith("Hello") and out.choices[1].text.startswith("The sky is")


def tier_count(server: Server, tier: str) -> float:
    """Finished requests of ``tier`` so far (its e2e latency histogram's count)."""
    name = f'iterserve_e2e_request_latency_seconds_count{{tier="{tier}"}}'
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_priority_by_tier_name_and_integer_is_labelled_by_its_tier(
    client: openai.OpenAI, server: Server
) -> None:
    for priority, tier in (("premium", "premium"), (2, "best-effort"), (7, "best-effort")):
        before = tier_count(server, tier)
        out = client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, extra_body={"priority": priority}
        )
        assert out.usage.completion_tokens == 2
        assert tier_count(server, tier) == before + 1


def test_cached_prompt_tokens_are_reported(client: openai.OpenAI) -> None:
    prompt = "A long shared system prompt about serving, said once. " * 12
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    details = second.usage.prompt_tokens_details
    # Every full block of the prompt but the one holding its last token (which is computed
    # again to sample from): 16-token blocks.
    num_prompt = second.usage.prompt_tokens
    assert details is not None and details.cached_tokens == (num_prompt - 1) // 16 * 16


def test_wrong_api_key_is_401(server: Server) -> None:
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_openai_errors_for_bad_parameters(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=10, temperature=-1)
    assert e.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-5", prompt="x", max_tokens=1)


def test_streamed_logprobs_cover_every_token(client: openai.OpenAI) -> None:
    entries, usage = [], None
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    ):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                entries += choice.logprobs.content
    assert usage is not None and len(entries) == usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 for e in entries)
