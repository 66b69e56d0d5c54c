"""The admin API on its own listener (``--admin-port``) and its tokens from a file
(``--admin-token-file``), re-read on change as a rotated Kubernetes Secret volume changes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fake_engine import FakeEngineClient, run_with_server
from server_utils import free_port, write_secret_volume

from iterserve.config import ConfigError, ServerConfig
from iterserve.server import admin_auth
from iterserve.server.admin_auth import AdminTokens
from iterserve.server.app import build_app
from iterserve.server.launch import listeners

URL = "/admin/scheduler_config"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_admin_port_serves_admin_only_and_the_public_port_hides_it(tokenizer: Any) -> None:
    """Two listeners of one server, as ``iterserve serve --admin-port`` binds them."""
    public_port, admin_port = free_port(), free_port()
    config = ServerConfig(host="127.0.0.1", port=public_port, admin_port=admin_port,
                          admin_token="adm")  # fmt: skip
    fake = FakeEngineClient(tokenizer, time.monotonic)
    app = build_app(fake, config, tokenizer=tokenizer)

    async def main() -> None:
        uv = uvicorn.Config(app, host="127.0.0.1", port=public_port, log_config=None,
                            access_log=False, lifespan="on")  # fmt: skip
        sockets = listeners(uv, config)
        assert sockets is not None and len(sockets) == 2
        server = uvicorn.Server(uv)
        task = asyncio.create_task(server.serve(sockets=sockets))
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            async with httpx.AsyncClient(timeout=10) as http:
                public = f"http://127.0.0.1:{public_port}"
                admin = f"http://127.0.0.1:{admin_port}"
                r = await http.get(public + URL, headers=bearer("adm"))
                assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
                assert (await http.get(public + "/load")).status_code == 200
                assert (
                    "/admin/scheduler_config"
                    not in (await http.get(public + "/openapi.json")).json()["paths"]
                )
                r = await http.put(admin + URL, json={"max_num_seqs": 7}, headers=bearer("adm"))
                assert r.status_code == 200 and r.json()["max_num_seqs"] == 7
                assert (await http.get(admin + URL)).status_code == 401
                assert (await http.get(admin + "/load")).status_code == 404  # admin only
                assert (await http.get(public + "/load")).json()["max_num_seqs"] == 7
        finally:
            server.should_exit = True
            await task
            for s in sockets:
                s.close()

    asyncio.run(main())


def test_token_file_is_reread_after_a_secret_swap_and_accepts_every_line(
    tokenizer: Any, tmp_path: Path
) -> None:
    path = write_secret_volume(tmp_path, "first\n", 1)
    config = ServerConfig(admin_token_file=str(path))

    async def check(http: httpx.AsyncClient, fake: FakeEngineClient) -> None:
        assert (await http.get(URL, headers=bearer("first"))).status_code == 200
        assert (await http.get(URL, headers=bearer("second"))).status_code == 401
        # A rotation: the new token first, the previous one still accepted.
        write_secret_volume(tmp_path, "second\nfirst\n", 2)
        assert (await http.get(URL, headers=bearer("second"))).status_code == 200
        assert (await http.get(URL, headers=bearer("first"))).status_code == 200
        # The next rotation drops the oldest.
        write_secret_volume(tmp_path, "third\nsecond\n", 3)
        assert (await http.get(URL, headers=bearer("first"))).status_code == 401
        assert (await http.get(URL, headers=bearer("third"))).status_code == 200

    run_with_server(tokenizer, check, config)


def test_token_file_read_once_per_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "token"
    path.write_text("a\n")
    reads: list[str] = []
    original = admin_auth.parse_tokens

    def counting(data: bytes, p: str) -> tuple[str, ...]:
        reads.append(p)
        return original(data, p)

    monkeypatch.setattr(admin_auth, "parse_tokens", counting)
    tokens = AdminTokens("flag-token", str(path))
    assert reads == [str(path)]
    assert tokens.accepted() == ("a", "flag-token") and tokens.accepted() == ("a", "flag-token")
    assert len(reads) == 1  # unchanged: stat'ed, not read
    path.write_text("b\na\n")
    assert tokens.accepted() == ("b", "a", "flag-token") and len(reads) == 2
    path.unlink()  # mid-swap: the tokens read last stay
    assert tokens.accepted() == ("b", "a", "flag-token")


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "No such file"), ("\n\n", "no token"), ("a b\n", "whitespace"), ("é\n", "ASCII")],
)
def test_an_unusable_token_file_is_refused_at_start(
    tmp_path: Path, content: str | None, message: str
) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        AdminTokens(None, str(path))


def test_admin_port_must_differ_from_the_port() -> None:
    with pytest.raises(ConfigError, match="admin_port"):
        ServerConfig(port=8000, admin_port=8000)
