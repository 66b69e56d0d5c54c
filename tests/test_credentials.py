"""The credentials files (``iterserve/credentials.py``): the keys file's validation messages
(file and entry named, never the key) and ``WatchedFile``'s re-read at most once per
interval, in place or by a new inode."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import yaml

from iterserve.credentials import (
    CredentialsError,
    Grant,
    WatchedFile,
    _KeysLoader,
    parse_api_keys,
    parse_tokens,
)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- {key: sk-secret-1, tenant: 5}", "entry 0: tenant: Input should be a valid string"),
        ("- {key: sk-secret-1, tenant: a, tiers: [x]}", "entry 0: default_tier is required"),
        ("- {key: sk-secret-1, tenant: a, tiers: [x], default_tier: y}", "'y' is not one of"),
        ("- {key: sk-secret-1, tenant: a, tiers: []}", "entry 0: tiers: List should have"),
        ("- {key: sk-secret-1, tenant: a, extra: 1}", "entry 0: extra: Extra inputs"),
        # A key pasted where a field belongs: not named.
        ("- {key: sk-secret-0, tenant: a, sk-secret-1: x}", "entry 0: a field: Extra inputs"),
        ("- {key: sk-secret-0, tenant: a, Sk-Secret-1: x}", "entry 0: a field: Extra inputs"),
        ("- {key: sk-secret-1, tenant: ' a'}", "entry 0: tenant: .*printable"),
        ("- {key: short, tenant: a}", "entry 0: key: String should have at least 8"),
        ("- {key: sk-secret-1, tenant: a}\n- {key: sk-secret-1, tenant: b}", "entry 1: the key"),
        ("{a: 1}", "the file: Input should be a valid list"),
        ("[", "not YAML"),
        # PyYAML's own message quotes the line it failed on (the key with it): never printed.
        ('- key: "sk-secret-1\n  tenant: a', r"not YAML: while scanning a quoted scalar.*line 2"),
        ("- {key: sk-secret-1 tenant: a}", r"not YAML: .*expected ',' or '}'.*\(line 1"),
        ("- {key: sk-secret-1, tenant: a}\n---\n- x", "not YAML: expected a single document"),
        ("- {key: *sk-secret-1, tenant: a}", "not YAML: found undefined alias( '...')? \\(line"),
        # A field given twice: PyYAML keeps the last silently (the first key lost unseen).
        ("- {key: sk-secret-1, tenant: a, tenant: b}", "not YAML: tenant given twice"),
        ("- key: sk-secret-0\n  key: sk-secret-1\n  tenant: a", "key given twice"),
        ("- {? [a]: 1, key: sk-secret-1, tenant: a}", "not YAML: while constructing a mapping"),
        # Nested past Python's recursion limit: a CredentialsError, not a RecursionError.
        ("[" * 50_000, "not YAML: (nested too deeply|.*exceeded maximum nesting depth)"),
        ("- " * 5_000 + "x", "not YAML: (nested too deeply|.*exceeded maximum nesting depth)"),
        ("", "no key"),
    ],
)
def test_a_bad_keys_file_names_the_file_and_entry_never_the_key(text: str, message: str) -> None:
    with pytest.raises(CredentialsError, match=message) as e:
        parse_api_keys(text.encode(), "/keys.yaml")
    assert str(e.value).startswith("/keys.yaml: ")
    assert "sk-secret-1" not in str(e.value)


def test_the_keys_file_is_parsed_with_libyaml() -> None:
    """A re-read runs on the event loop: PyYAML's pure-Python loader took 0.8 s per 1000 keys
    (every stream on the router stalled that long); libyaml's is about 5 times faster. PyPI's
    PyYAML wheels bundle libyaml, which the install takes: a PyYAML without it fails here."""
    assert yaml.__with_libyaml__, "PyYAML built without libyaml: keys files parse slowly"
    assert issubclass(_KeysLoader, yaml.CSafeLoader)
    keys = "".join(f"- {{key: sk-key-{i:06d}, tenant: t{i}}}\n" for i in range(1000))
    assert len(parse_api_keys(keys.encode(), "f")) == 1000


def test_a_merge_key_is_not_a_field_given_twice() -> None:
    keys = parse_api_keys(
        b"- &a {key: sk-acme-0001, tenant: acme}\n- {<<: *a, key: sk-acme-0002}", "f"
    )
    assert len(keys) == 2


def test_grants_and_tokens() -> None:
    keys = parse_api_keys(
        b"- {key: sk-acme-0001, tenant: acme, tiers: [standard], default_tier: standard}", "f"
    )
    assert keys.grant_for(b"bearer  sk-acme-0001") == Grant(
        "acme", frozenset({"standard"}), "standard"
    )
    assert keys.grant_for(b"Bearer sk-acme-000") is None and keys.grant_for(b"") is None
    assert parse_tokens(b"  tok-12345678\n\n old-1234\n", "t") == ("tok-12345678", "old-1234")
    with pytest.raises(CredentialsError, match="t: token 1 has whitespace"):
        parse_tokens(b"tok 12345678", "t")
    with pytest.raises(CredentialsError, match="t: no token"):
        parse_tokens(b" \n", "t")


def test_a_watched_file_is_stat_ed_at_most_once_per_interval(tmp_path: Path) -> None:
    now = [100.0]
    path = tmp_path / "token"
    path.write_text("token-aaaaaaaa")
    watched = WatchedFile(str(path), parse_tokens, check_interval_s=1.0, clock=lambda: now[0])
    path.write_text("token-bbbbbbbb")  # in place: same inode and size, a new mtime
    os.utime(path, ns=(1, 1))
    now[0] += 0.5
    assert watched.current() == ("token-aaaaaaaa",)  # not checked yet
    now[0] += 0.5
    assert watched.current() == ("token-bbbbbbbb",)
    (tmp_path / "new").write_text("token-cccccccc")
    os.replace(tmp_path / "new", path)  # a new inode
    now[0] += 1.0
    assert watched.current() == ("token-cccccccc",)
    path.unlink()  # gone: the last good one stays
    now[0] += 1.0
    assert watched.current() == ("token-cccccccc",)
    with pytest.raises(CredentialsError, match="No such file"):
        WatchedFile(str(path), parse_tokens)


def test_a_missing_file_is_logged_once_not_every_second(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by the breaker: a deleted (or unreadable) file logged an ERROR at every check,
    once a second for as long as it stayed gone."""
    now = [100.0]
    path = tmp_path / "token"
    path.write_text("token-aaaaaaaa")
    watched = WatchedFile(str(path), parse_tokens, check_interval_s=1.0, clock=lambda: now[0])
    path.unlink()
    with caplog.at_level(logging.ERROR, "iterserve.credentials"):
        for _ in range(5):
            now[0] += 1.0
            assert watched.current() == ("token-aaaaaaaa",)
        assert caplog.text.count("cannot be read") == 1
        path.write_text("token-bbbbbbbb")
        now[0] += 1.0
        assert watched.current() == ("token-bbbbbbbb",)
        path.unlink()  # gone again: logged again
        now[0] += 1.0
        assert watched.current() == ("token-bbbbbbbb",)
    assert caplog.text.count("cannot be read") == 2
