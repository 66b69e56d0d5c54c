"""Seeded benchmark workloads cut from real English text, and a JSONL trace format.

Prompts are windows of tokens cut from the docstrings of the Python standard library (present
on every machine, real English prose and code), decoded back to text, so tokenization in the
server under test is realistic. Output lengths are enforced with ``ignore_eos`` and
``min_tokens = max_tokens`` (``--plain`` servers get ``max_tokens`` only).

Workloads (``--workload``):

- ``mixed``: prompt lengths log-normal (median 200 tokens, sigma 0.8, clipped to 16-1024);
  output lengths 50% uniform 8-48, 35% 48-192, 15% 192-512.
- ``long-prompt``: one request in ten with a 3,000-4,000-token prompt, the rest 100-300.
- ``shared-prefix``: one 500-token system prompt shared by all, plus 50-200 tokens each; with
  ``num_prefixes`` N > 1, N distinct system prompts, each request one of them drawn uniformly
  (its own seeded generator, so the tails are those of any other N with the same seed).
  Decision: uniform, as the prefix-group workloads of the Gateway API Inference Extension's and
  SGLang's benchmarks; a Zipf skew would mostly measure the load bound on the hot prefixes.

Trace (JSONL, one request per line, docs/simulator.md): ``{"timestamp": s, "prompt": str,
"max_tokens": int}`` plus optional ``min_tokens``, ``priority`` (tier name or integer),
``tenant``, ``messages`` (chat, instead of ``prompt``) and ``prompt_len`` (tokens; an entry
may give it instead of a prompt, which ``iterserve simulate`` accepts and ``bench serve``
refuses); ``timestamp`` is the arrival in seconds from the start (replayed as recorded).
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import random
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

WORKLOADS = ("mixed", "long-prompt", "shared-prefix")
SYSTEM_PROMPT_LEN = 500  # tokens of shared-prefix's system prompts

# Standard-library modules whose docstrings make the corpus (fixed, for reproducibility).
_CORPUS_MODULES = (
    "argparse", "asyncio", "bisect", "calendar", "collections", "contextlib", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum", "fractions",
    "functools", "gettext", "heapq", "http.client", "http.server", "inspect", "ipaddress",
    "itertools", "json", "logging", "mailbox", "os", "pathlib", "pickle", "pprint", "queue",
    "random", "re", "shutil", "smtplib", "socket", "sqlite3", "statistics", "string",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "typing", "unittest",
    "urllib.parse", "urllib.request", "uuid", "zipfile",
)  # fmt: skip


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload.

    Attributes:
        prompt: the prompt text.
        prompt_len: its length in tokens as cut (the server may count one or two differently).
        output_len: tokens to generate (``max_tokens``; also ``min_tokens`` unless plain).
        arrival_s: arrival time from the start (traces); None: set by the arrival process.
        priority: tier name or integer (None: the server's default tier).
        min_tokens: a trace's own ``min_tokens`` (None: ``output_len`` unless plain).
        tenant: who sent it (traces).
        messages: a chat request's messages (``prompt`` is then empty).
    """

    prompt: str
    prompt_len: int
    output_len: int
    arrival_s: float | None = None
    priority: str | int | None = None
    min_tokens: int | None = None
    tenant: str | None = None
    messages: list[dict[str, str]] | None = None


def corpus_text() -> str:
    """The docstrings of a fixed list of standard-library modules, in a fixed order."""
    with warnings.catch_warnings():  # deprecated aliases warn when touched
        warnings.simplefilter("ignore")
        return "\n\n".join(_docstrings())


def _docstrings() -> list[str]:
    parts: list[str] = []
    for name in _CORPUS_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        doc = inspect.getdoc(module)
        if doc:
            parts.append(doc)
        for attr in sorted(vars(module)):
            if attr.startswith("_"):
                continue
            obj = getattr(module, attr)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == name:
                doc = inspect.getdoc(obj)
                if doc and len(doc) > 80:
                    parts.append(doc)
    return parts


class PromptCutter:
    """Cuts prompts of exact token lengths from the corpus.

    Args:
        tokenizer: a Hugging Face tokenizer (``encode``/``decode``).
        rng: the workload's random generator.
    """

    def __init__(self, tokenizer: Any, rng: random.Random) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self.tokens: list[int] = list(tokenizer(corpus_text(), add_special_tokens=False).input_ids)

    def cut(self, num_tokens: int) -> str:
        num_tokens = max(1, min(num_tokens, len(self.tokens) - 1))
        start = self.rng.randrange(0, len(self.tokens) - num_tokens)
        return str(self.tokenizer.decode(self.tokens[start : start + num_tokens]))


def _mixed_output_len(rng: random.Random) -> int:
    u = rng.random()
    if u < 0.50:
        return rng.randint(8, 48)
    if u < 0.85:
        return rng.randint(48, 192)
    return rng.randint(192, 512)


def make_workload(
    name: str,
    tokenizer: Any,
    num_requests: int = 64,
    seed: int = 0,
    max_output_len: int = 512,
    num_prefixes: int = 1,
) -> list[BenchRequest]:
    """The requests of workload ``name`` (see the module docstring), reproducible by ``seed``.

    Args:
        tokenizer: cuts the prompts; None gives requests with lengths only (``prompt`` empty,
            ``prompt_len`` set: what ``iterserve simulate`` accepts without a tokenizer).
        max_output_len: clip output lengths (``--smoke`` runs use short outputs).
        num_prefixes: ``shared-prefix``'s distinct 500-token system prompts (1: one for all).

    Raises:
        ValueError: unknown workload name; ``num_prefixes`` < 1, or > 1 for another workload.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS} or give a trace")
    if num_prefixes < 1 or (num_prefixes > 1 and name != "shared-prefix"):
        raise ValueError(
            f"num_prefixes must be >= 1 (and > 1 only for shared-prefix), got {num_prefixes}"
        )
    rng = random.Random(seed)
    prefix_rng = random.Random(f"prefixes-{seed}")  # which system prompt: apart from the tails
    cutter = PromptCutter(tokenizer, rng) if tokenizer is not None else None
    requests: list[BenchRequest] = []
    systems = [""]
    if name == "shared-prefix" and cutter is not None:
        systems = [cutter.cut(SYSTEM_PROMPT_LEN) for _ in range(num_prefixes)]
    for i in range(num_requests):
        if name == "mixed":
            prompt_len = int(min(1024, max(16, rng.lognormvariate(math.log(200), 0.8))))
        elif name == "long-prompt":
            prompt_len = rng.randint(3000, 4000) if i % 10 == 0 else rng.randint(100, 300)
        else:
            prompt_len = rng.randint(50, 200)
        output_len = min(max_output_len, _mixed_output_len(rng))
        prompt = cutter.cut(prompt_len) if cutter is not None else ""
        if name == "shared-prefix":
            system = systems[prefix_rng.randrange(len(systems))]
            prompt = system + "\n\n" + prompt if system else prompt
            prompt_len += SYSTEM_PROMPT_LEN
        requests.append(BenchRequest(prompt, prompt_len, output_len))
    return requests


def load_trace(path: Path) -> list[BenchRequest]:
    """Requests from a JSONL trace (see the module docstring).

    Raises:
        ValueError: a line that is not a request object.
    """
    requests = []
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a UTF-8 JSONL file ({e.reason})") from e
    for num, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            requests.append(_trace_entry(json.loads(line)))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{num}: not a trace entry ({e}): {line[:80]!r}") from e
    return requests


def _trace_entry(entry: Any) -> BenchRequest:
    if not isinstance(entry, dict):
        raise ValueError("a trace entry is a JSON object")
    messages = entry.get("messages")
    if messages is not None and not (
        isinstance(messages, list)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    ):
        raise ValueError("messages must be a list of objects with a role")
    prompt = entry.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError("prompt must be a string")
    if prompt is None and messages is None and "prompt_len" not in entry:
        raise KeyError("prompt (or messages, or prompt_len)")
    timestamp = float(entry["timestamp"]) if "timestamp" in entry else None
    if timestamp is not None and not 0 <= timestamp < math.inf:
        raise ValueError(f"timestamp must be a number of seconds >= 0, got {timestamp}")
    min_tokens = entry.get("min_tokens")
    tenant = entry.get("tenant")
    return BenchRequest(
        prompt=prompt or "",
        prompt_len=int(entry.get("prompt_len", 0)),
        output_len=int(entry["max_tokens"]),
        arrival_s=timestamp,
        priority=entry.get("priority"),
        min_tokens=None if min_tokens is None else int(min_tokens),
        tenant=None if tenant is None else str(tenant),
        messages=messages,
    )


def save_trace(requests: list[BenchRequest], path: Path) -> None:
    """Write requests as a JSONL trace (``load_trace`` reads it back)."""
    with path.open("w") as f:
        for r in requests:
            entry: dict[str, Any] = {k: v for k, v in asdict(r).items() if v is not None}
            entry["max_tokens"] = entry.pop("output_len")
            if "arrival_s" in entry:
                entry["timestamp"] = entry.pop("arrival_s")
            f.write(json.dumps(entry, ensure_ascii=False) + "\n")
