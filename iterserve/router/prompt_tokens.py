"""A request's prompt as the replicas' token ids, for matching it against their KV events.

The router tokenizes as an iterserve server does (:mod:`iterserve.server.serving`), with the
torch-free tokenizers of :mod:`iterserve.sim.tokenizer`:

- ``/v1/completions``: a string prompt is encoded with the tokenizer's special tokens (its
  BOS); a prompt of token ids is taken as it is; a list of prompts is matched by its first.
- ``/v1/chat/completions``: the messages (string content, or text parts joined) through the
  chat template with ``add_generation_prompt`` (the body's, default true), then encoded
  without special tokens (the template spells them out).

``--tokenizer`` names the tokenizer (:func:`load_prompt_tokenizer`): a ``tokenizer.json`` or
a model directory holding one (Hugging Face's layout, chat template included); ``char`` or
``char:VOCAB`` for simulated replicas without a tokenizer file (~4 characters per token over
``VOCAB`` ids, the profile's; 49152 by default, the default model's); unset, the default
model's directory as ``iterserve serve`` converted it into the iterserve cache.

A body the tokenizer cannot take (a template that raises, lone surrogates) gives None: the
request is placed by its prefix hash, and the replica answers it with its own 400.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from iterserve import envs
from iterserve.sim.tokenizer import CharTokenizer, FileTokenizer

logger = logging.getLogger("iterserve.router")

DEFAULT_VOCAB_SIZE = 49152  # the default model's (SmolLM2), and the cpu-smollm2 profile's
# ``iterserve serve`` converts the default model into the cache under this name + its hash.
DEFAULT_MODEL_DIR_GLOB = "SmolLM2-135M-Instruct*"

Tokenizer = CharTokenizer | FileTokenizer


def load_prompt_tokenizer(spec: str | None) -> Tokenizer:
    """The tokenizer ``--tokenizer spec`` names (see the module docstring).

    Raises:
        ValueError: no such file or directory, a file that is not a tokenizer, a bad
            ``char:VOCAB``, or (unset) no converted default model in the cache.
    """
    if spec is None:
        return _default_model_tokenizer()
    if spec == "char" or spec.startswith("char:"):
        vocab = spec.partition(":")[2] or str(DEFAULT_VOCAB_SIZE)
        if not vocab.isdigit() or int(vocab) < 4:
            raise ValueError(f"--tokenizer {spec!r}: char:VOCAB needs a vocabulary size >= 4")
        return CharTokenizer(int(vocab))
    path = Path(spec).expanduser()
    if path.is_file():
        if path.name != "tokenizer.json":
            raise ValueError(f"--tokenizer {spec}: give a tokenizer.json or its directory")
        path = path.parent
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"--tokenizer {spec}: no tokenizer.json there")
    try:
        return FileTokenizer(path)
    except Exception as e:  # the tokenizers library raises plain Exception
        raise ValueError(f"--tokenizer {spec}: cannot read it ({type(e).__name__}: {e})") from e


def _default_model_tokenizer() -> Tokenizer:
    models = envs.cache_dir() / "models"
    found = sorted(models.glob(f"{DEFAULT_MODEL_DIR_GLOB}/tokenizer.json"))
    if not found:
        raise ValueError(
            f"--kv-events-port needs the replicas' tokenizer: give --tokenizer PATH (a "
            f"tokenizer.json or a model directory) or char[:VOCAB] for simulated replicas; "
            f"the default model's was not found under {models} (an `iterserve serve` of the "
            f"default model puts it there)"
        )
    # Said at start: simulated replicas without a tokenizer file cut prompts ~4 characters
    # per token, so this tokenizer would match none of their blocks (hash placement only).
    logger.info(
        "KV events: prompts tokenized with the default model's tokenizer (%s); replicas of "
        "another model, or simulated ones without a tokenizer file, need --tokenizer "
        "(PATH, or char[:VOCAB])",
        found[-1].parent,
    )
    return FileTokenizer(found[-1].parent)


def prompt_token_ids(tokenizer: Tokenizer, body: Mapping[str, Any]) -> list[int] | None:
    """The prompt of a generation ``body`` as token ids (see the module docstring); None for
    a body with no prompt this can read."""
    try:
        messages = body.get("messages")
        if isinstance(messages, list):
            return _chat_ids(tokenizer, messages, body.get("add_generation_prompt", True))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            prompt = prompt[0]  # a batch of prompts: its first
        if isinstance(prompt, str):
            return list(tokenizer(prompt, add_special_tokens=True).input_ids)
        if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return list(prompt)
    except Exception as e:  # the template's raise_exception, a lone surrogate, ...
        logger.debug("prompt not tokenized (%s: %s)", type(e).__name__, e)
    return None


def _chat_ids(
    tokenizer: Tokenizer, messages: list[Any], generation_prompt: Any
) -> list[int] | None:
    conversation = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return None
        content = m.get("content")
        if isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                return None  # a non-text part: the replica refuses it
            content = "".join(str(t) for t in texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            return None
        conversation.append({"role": m["role"], "content": content})
    text = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=generation_prompt is not False
    )
    return list(tokenizer(str(text), add_special_tokens=False).input_ids)
