"""The bearer tokens ``/admin/*`` accepts: ``--admin-token`` (or ``ITERSERVE_ADMIN_TOKEN``) and
the tokens of ``--admin-token-file``, re-read whenever the file changes.

The file holds one token per line (blank lines ignored), every one accepted: the operator
rotates a token by writing ``NEW\\nOLD`` into its Secret, so a push sent with either works
while the kubelet has not yet given every pod the new file (docs/server.md, "Admin API").
A Kubernetes Secret volume replaces its files by swapping a ``..data`` symlink: the file is
stat'ed through its links on every admin request (one ``stat`` call) and read again when the
resolved file's identity, size or modification time changed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from iterserve.config import ConfigError
from iterserve.openai_http import bearer_matches

logger = logging.getLogger("iterserve.server")

_FileKey = tuple[int, int, int, int]  # (st_dev, st_ino, st_size, st_mtime_ns)


def read_token_file(path: str) -> tuple[str, ...]:
    """The tokens of ``path``, one per line, in order.

    Raises:
        ConfigError: the file cannot be read, is not UTF-8, or a line holds control characters
            or inner whitespace (no HTTP client can send such a token).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--admin-token-file {path}: {e}") from e
    tokens = tuple(line.strip() for line in text.splitlines() if line.strip())
    for number, token in enumerate(tokens, 1):
        if not token.isprintable() or any(c.isspace() for c in token):
            raise ConfigError(
                f"--admin-token-file {path}: token {number} has whitespace or control characters"
            )
    return tokens


class AdminTokens:
    """What ``/admin/*`` accepts (see the module docstring).

    Args:
        token: ``--admin-token``, accepted as long as the server runs.
        token_file: ``--admin-token-file``; read now (a ``ConfigError`` if it cannot be, or
            holds no token) and again on change. A later unreadable or malformed version keeps
            the tokens last read (logged); an empty one accepts none of its tokens.
        stat: ``os.stat`` (tests count calls).

    Raises:
        ConfigError: the file cannot be read or holds no token.
    """

    def __init__(
        self,
        token: str | None = None,
        token_file: str | None = None,
        stat: Callable[[str], os.stat_result] = os.stat,
    ) -> None:
        self.token = token
        self.token_file = token_file
        self._stat = stat
        self._file_key: _FileKey | None = None
        self._file_tokens: tuple[str, ...] = ()
        if token_file is not None:
            self._file_key = self._key()
            self._file_tokens = read_token_file(token_file)
            if not self._file_tokens:
                raise ConfigError(f"--admin-token-file {token_file}: no token in it")

    @property
    def enabled(self) -> bool:
        """Whether the admin API is on (a token or a token file was given)."""
        return self.token is not None or self.token_file is not None

    def _key(self) -> _FileKey:
        assert self.token_file is not None
        try:
            s = self._stat(self.token_file)  # follows the ..data symlink of a Secret volume
        except OSError as e:
            raise ConfigError(f"--admin-token-file {self.token_file}: {e}") from e
        return (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns)

    def accepted(self) -> tuple[str, ...]:
        """The tokens accepted now: the file's (read again if it changed), then the flag's."""
        if self.token_file is not None:
            try:
                key = self._key()
                if key != self._file_key:
                    self._file_tokens = read_token_file(self.token_file)
                    self._file_key = key
                    logger.info(
                        "admin token file %s re-read: %d tokens accepted",
                        self.token_file,
                        len(self._file_tokens),
                    )
            except ConfigError as e:  # mid-swap or removed: keep what was read last
                logger.warning("%s; keeping the tokens read before", e)
        return (*self._file_tokens, *((self.token,) if self.token is not None else ()))

    def matches(self, authorization: bytes) -> bool:
        """Whether an ``Authorization`` header carries an accepted token (each compared in
        constant time)."""
        return any(bearer_matches(authorization, token) for token in self.accepted())
