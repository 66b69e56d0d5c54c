"""The bearer tokens ``/admin/*`` accepts: ``--admin-token`` (or ``ITERSERVE_ADMIN_TOKEN``) and
the tokens of ``--admin-token-file``, re-read whenever the file changes.

The file holds one token per line (:func:`iterserve.credentials.parse_tokens`), every one
accepted: the operator rotates a token by writing ``NEW\\nOLD`` into its Secret, so a push
sent with either works while the kubelet has not yet given every pod the new file
(docs/server.md, "Admin API"). The file is a :class:`~iterserve.credentials.WatchedFile`
checked on every admin request (one ``stat`` through the Secret volume's ``..data`` link).
"""

from __future__ import annotations

from iterserve.config import ConfigError
from iterserve.credentials import CredentialsError, WatchedFile, parse_tokens
from iterserve.openai_http import bearer_matches


class AdminTokens:
    """What ``/admin/*`` accepts (see the module docstring).

    Args:
        token: ``--admin-token``, accepted as long as the server runs.
        token_file: ``--admin-token-file``; read now and again on change. A later unreadable
            or malformed version keeps the tokens last read (logged).

    Raises:
        ConfigError: the file cannot be read or holds no usable token.
    """

    def __init__(self, token: str | None = None, token_file: str | None = None) -> None:
        self.token = token
        self.token_file = token_file
        self._file: WatchedFile[tuple[str, ...]] | None = None
        if token_file is not None:
            try:
                self._file = WatchedFile(token_file, parse_tokens, check_interval_s=0.0)
            except CredentialsError as e:
                raise ConfigError(f"--admin-token-file {e}") from e

    @property
    def enabled(self) -> bool:
        """Whether the admin API is on (a token or a token file was given)."""
        return self.token is not None or self.token_file is not None

    def accepted(self) -> tuple[str, ...]:
        """The tokens accepted now: the file's (read again if it changed), then the flag's."""
        from_file = self._file.current() if self._file is not None else ()
        return (*from_file, *((self.token,) if self.token is not None else ()))

    def matches(self, authorization: bytes) -> bool:
        """Whether an ``Authorization`` header carries an accepted token (each compared in
        constant time)."""
        return any(bearer_matches(authorization, token) for token in self.accepted())
