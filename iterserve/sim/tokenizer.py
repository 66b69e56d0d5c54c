"""Tokenizers for simulated replicas, without torch or transformers.

``transformers.AutoTokenizer`` imports torch, which the control-plane image does not have and
which would cost a simulated replica ~200 MB and seconds of start-up. So:

- :class:`FileTokenizer` reads a Hugging Face tokenizer directory with the ``tokenizers``
  library (``tokenizer.json``) and renders its chat template with jinja2 in a sandbox, as
  transformers does (``trim_blocks``, ``lstrip_blocks``, ``raise_exception``). Text is the
  real tokenizer's.
- :class:`CharTokenizer` is for when there is no tokenizer file: about 4 characters per
  token. A prompt of ``n`` characters is ``ceil(n / 4)`` tokens, each id a hash
  of its 4 characters (so equal prefixes give equal ids and prefix caching behaves); an id
  decodes to a 4-character pseudo-word (``" kqa"``). Ids 0-2 are the special tokens
  ``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>`` (the EOS).

Both expose what the server and the engine use of a Hugging Face tokenizer: ``__call__``
(``.input_ids``), ``decode``, ``apply_chat_template``, ``eos_token_id``, and
:meth:`ordinary_token_ids` (ids a simulated runner may emit as text).
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

CHARS_PER_TOKEN = 4
_WORD = re.compile(r"^ ?[A-Za-z]{2,}$")


@dataclass(frozen=True)
class Encoding:
    input_ids: list[int]


class CharTokenizer:
    """~4 characters per token (see the module docstring).

    Args:
        vocab_size: ids are in ``[0, vocab_size)``; at least 4.
    """

    SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    eos_token_id = 2

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 4:
            raise ValueError(f"vocab_size must be >= 4, got {vocab_size}")
        self.vocab_size = vocab_size
        self._num_ordinary = vocab_size - len(self.SPECIAL_TOKENS)

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        # A lone surrogate raises UnicodeEncodeError here, as the real tokenizer refuses it.
        ids = [
            len(self.SPECIAL_TOKENS)
            + zlib.crc32(text[i : i + CHARS_PER_TOKEN].encode()) % self._num_ordinary
            for i in range(0, len(text), CHARS_PER_TOKEN)
        ]
        return Encoding(ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self._piece(t, skip_special_tokens) for t in token_ids)

    def _piece(self, token_id: int, skip_special_tokens: bool) -> str:
        if token_id < len(self.SPECIAL_TOKENS):
            return "" if skip_special_tokens else self.SPECIAL_TOKENS[token_id]
        k = (token_id - len(self.SPECIAL_TOKENS)) % (26**3)
        return " " + "".join(chr(ord("a") + (k // 26**i) % 26) for i in range(3))

    def apply_chat_template(
        self, conversation: list[dict[str, str]], tokenize: bool = False, **kwargs: Any
    ) -> str:
        """``role: content`` lines, then ``assistant:`` with ``add_generation_prompt``."""
        text = "".join(f"{m['role']}: {m['content']}\n" for m in conversation)
        return text + ("assistant:" if kwargs.get("add_generation_prompt") else "")

    def ordinary_token_ids(self) -> list[int]:
        return list(range(len(self.SPECIAL_TOKENS), self.vocab_size))


class FileTokenizer:
    """A Hugging Face tokenizer directory, read without transformers (see the module
    docstring).

    Args:
        model_dir: holds ``tokenizer.json`` and, for chat, ``chat_template.jinja`` or a
            ``chat_template`` in ``tokenizer_config.json``.

    Raises:
        FileNotFoundError: no ``tokenizer.json`` in ``model_dir``.
    """

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        self.backend_tokenizer = Tokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_id = (
            self.backend_tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        )
        template_path = model_dir / "chat_template.jinja"
        template = template_path.read_text() if template_path.is_file() else None
        self._chat_template: str | None = template or config.get("chat_template")
        self._compiled: Any = None
        self.vocab_size = self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        return Encoding(
            self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        )

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(
            self.backend_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        )

    def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text of ``conversation`` (``tokenize=True`` is not supported).

        Raises:
            ValueError: the directory has no chat template; the template's own
                ``raise_exception``.
        """
        if tokenize:
            raise ValueError("tokenize=True is not supported; encode the returned text")
        if self._chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._compiled is None:
            self._compiled = _compile_template(self._chat_template)
        return str(
            self._compiled.render(
                messages=conversation,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        )

    def ordinary_token_ids(self) -> list[int]:
        """Ids that decode to a plain word (letters, with or without a leading space)."""
        special = set(self.backend_tokenizer.get_added_tokens_decoder())
        ids = []
        for token_id in range(self.backend_tokenizer.get_vocab_size(with_added_tokens=False)):
            if token_id not in special and _WORD.match(self.decode([token_id])):
                ids.append(token_id)
        return ids


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...} in older configs
        return str(value.get("content"))
    return None if value is None else str(value)


def _compile_template(source: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    return env.from_string(source)


def load_tokenizer(model: str | None, vocab_size: int) -> CharTokenizer | FileTokenizer:
    """The tokenizer of directory ``model`` when it has a ``tokenizer.json``; a
    :class:`CharTokenizer` over ``vocab_size`` ids for None (or a directory without one).

    Raises:
        ValueError: ``model`` does not exist, or its tokenizer files cannot be read.
    """
    if not model:
        return CharTokenizer(vocab_size)
    path = Path(model)
    if not path.exists():
        raise ValueError(f"{model}: no such tokenizer directory")
    if not (path / "tokenizer.json").is_file():
        return CharTokenizer(vocab_size)
    try:
        return FileTokenizer(path)
    except Exception as e:  # the tokenizers library raises plain Exception
        raise ValueError(f"{model}: cannot read its tokenizer ({type(e).__name__}: {e})") from e
