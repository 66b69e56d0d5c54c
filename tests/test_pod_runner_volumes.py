"""The local cluster's pod runner lays out ConfigMap and Secret volumes as the kubelet's
AtomicWriter does, so that a reader of a refreshed volume (the server's admin token file)
sees the old files or the new, and a swap changes the file a path resolves to."""

from __future__ import annotations

from pathlib import Path

from localcluster.pod_runner import _atomic_write, _items


def test_a_refresh_swaps_data_and_keeps_the_paths(tmp_path: Path) -> None:
    assert _atomic_write(tmp_path, _items({"token": "a\n", "other": "x"}, None))
    token = tmp_path / "token"
    assert token.is_symlink() and token.read_text() == "a\n"
    first = token.resolve()
    assert not _atomic_write(tmp_path, {"token": "a\n", "other": "x"})  # unchanged: no swap
    assert _atomic_write(tmp_path, {"token": "b\na\n"})  # a key removed, one changed
    assert token.read_text() == "b\na\n" and token.resolve() != first
    assert not first.exists() and not (tmp_path / "other").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("..")) == ["token"]


def test_items_pick_and_rename_keys() -> None:
    data = {"token": "t", "unused": "u"}
    assert _items(data, [{"key": "token", "path": "dir/admin"}]) == {"dir/admin": "t"}
