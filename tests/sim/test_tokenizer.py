"""The simulator's torch-free tokenizers: the real tokenizer file read without transformers
agrees with transformers; the character tokenizer counts ~4 characters per token."""

from __future__ import annotations

from typing import Any

import pytest

from iterserve.engine.detokenizer import IncrementalDetokenizer
from iterserve.engine.sampling_params import SamplingParams
from iterserve.sim.tokenizer import CharTokenizer, FileTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def default_model_dir() -> Any:
    from iterserve.models.loader import resolve_model_dir

    return resolve_model_dir("default")


@pytest.mark.model
def test_file_tokenizer_agrees_with_transformers(default_model_dir: Any) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(default_model_dir))
    ours = FileTokenizer(default_model_dir)
    text = "Paged attention reads K/V through the block table. 日本語もOK 🚀"
    assert ours(text).input_ids == hf(text).input_ids
    assert (
        ours(text, add_special_tokens=False).input_ids
        == hf(text, add_special_tokens=False).input_ids
    )
    ids = hf(text).input_ids
    assert ours.decode(ids) == hf.decode(ids)
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
    ]
    for gen in (True, False):
        expected = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(conversation, add_generation_prompt=gen) == expected
    # Without a system message the template adds its default one, as transformers renders it.
    user_only = conversation[1:2]
    assert ours.apply_chat_template(user_only) == hf.apply_chat_template(user_only, tokenize=False)
    assert ours.eos_token_id == hf.eos_token_id == 2
    ordinary = ours.ordinary_token_ids()
    assert len(ordinary) > 10_000 and 2 not in ordinary
    assert all(ours.decode([t]).strip().isalpha() for t in ordinary[:500])
    assert isinstance(load_tokenizer(str(default_model_dir), 49152), FileTokenizer)


def test_char_tokenizer_counts_four_characters_per_token() -> None:
    tok = CharTokenizer(1000)
    assert len(tok("x" * 400).input_ids) == 100
    assert len(tok("x" * 401).input_ids) == 101
    assert tok("same prefix, then A").input_ids[:3] == tok("same prefix, then B").input_ids[:3]
    assert all(3 <= t < 1000 for t in tok("any text at all").input_ids)
    assert tok.decode([2], skip_special_tokens=True) == ""
    assert tok.decode([7, 8]) == tok.decode([7]) + tok.decode([8])
    assert len(tok.decode([7])) == 4
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert prompt == "user: hi\nassistant:"
    with pytest.raises(UnicodeEncodeError):
        tok("lone \ud800 surrogate")
    assert isinstance(load_tokenizer(None, 1000), CharTokenizer)


def test_the_detokenizer_takes_a_tokenizer_without_a_backend() -> None:
    tok = CharTokenizer(1000)
    detok = IncrementalDetokenizer(tok, [5, 6], SamplingParams(stop=[tok.decode([9])]))
    assert detok.append(7) is None
    assert detok.append(9) == tok.decode([9])
    assert detok.text == tok.decode([7])
