"""A simulated replica's HTTP front, as the server's: what it tokenizes, what it refuses with
a 400 or a 429, and how an admitted request reaches the engine."""

from __future__ import annotations

import random
from typing import Any

from iterserve.engine.errors import InvalidRequestError
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.messages import AddRequest
from iterserve.engine.sampling_params import SamplingParams
from iterserve.server.admission import Admission, Rejected
from iterserve.server.protocol import APIError
from iterserve.server.tenants import resolve_tenant
from iterserve.sim.replica import SimTokenizer
from iterserve.workload.stats import RequestRecord
from iterserve.workload.workloads import BenchRequest


def tier_label(priority: str | int | None) -> str:
    """The tier a record is reported under, as ``bench serve`` labels it."""
    return "default" if priority is None else str(priority)


def prompt_token_ids(
    req: BenchRequest,
    tokenizer: SimTokenizer,
    rng: random.Random,
    ordinary: list[int],
    max_len: int,
) -> list[int]:
    """What the server would tokenize: the chat template of ``messages`` (text parts of a
    content list joined, as the server does), else the prompt; an entry with only
    ``prompt_len`` gets that many seeded ordinary ids (at most ``max_len``: more is refused
    anyway).

    Raises:
        ValueError: what the server answers 400 to (empty prompt or messages, a content the
            template or the tokenizer refuses).
    """
    if req.messages is not None:
        if not req.messages:
            raise ValueError("messages is empty")
        conversation = [
            {"role": m["role"], "content": _text(m.get("content"))} for m in req.messages
        ]
        try:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
        except Exception as e:  # the template's own checks (jinja raise_exception, ...)
            raise ValueError(f"the chat template rejects these messages: {e}") from e
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    if req.prompt:
        return list(tokenizer(req.prompt).input_ids)
    if req.prompt_len < 1:
        raise ValueError("the prompt is empty")
    return [rng.choice(ordinary) for _ in range(min(req.prompt_len, max_len))]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    raise ValueError(f"message content must be a string or a list of parts, got {content!r}")


def admit(
    request_id: str,
    req: BenchRequest,
    record: RequestRecord,
    engine: LLMEngine,
    admission: Admission,
    t: float,
    tokenizer: SimTokenizer,
    rng: random.Random,
    ordinary: list[int],
    rejected: dict[str, int],
) -> bool:
    """The replica's HTTP front, as ``serving.py``: validate (400), admit (429), queue, and
    add the request to ``engine`` at virtual time ``t`` (seconds).

    Returns False when the request was refused: ``record`` gets its status and error, and
    ``rejected`` (reason -> count: ``queue_full``, ``queue_wait``, ... and ``invalid``) counts
    it.
    """
    min_tokens = req.output_len if req.min_tokens is None else req.min_tokens
    try:
        token_ids = prompt_token_ids(req, tokenizer, rng, ordinary, engine.max_model_len + 1)
        record.prompt_tokens = len(token_ids)
        params = SamplingParams(
            max_tokens=req.output_len, min_tokens=min_tokens, ignore_eos=True, temperature=0.0
        )
        priority = engine.resolve_priority(req.priority)
        engine.validate(token_ids, params)
        tenant = resolve_tenant(None, req.tenant)  # the trace's tenant, as the user field
        admission.check(engine.scheduler.config, priority, tenant=tenant)
    except Rejected as e:
        record.status, record.error = e.status, e.reason
        rejected[e.reason] = rejected.get(e.reason, 0) + 1
        return False
    except (InvalidRequestError, APIError, ValueError, KeyError) as e:  # ValueError: encoding too
        record.status, record.error = 400, str(e)
        rejected["invalid"] = rejected.get("invalid", 0) + 1  # as the server's metric counts
        return False
    admission.enqueue(request_id, priority, tenant)
    engine.add(AddRequest(request_id, token_ids, params, priority, t, tenant=tenant))
    return True
