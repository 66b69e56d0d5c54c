"""Credentials shared by the router and the server: the API-keys file (key -> tenant and
tiers), the router token, files re-read when they change, and the trusted headers the router
sets for the replicas (docs/router.md, "API keys and tenants").

The keys file is YAML, a list of entries::

    - key: sk-acme-1            # the Bearer a client sends
      tenant: acme              # its tenant, whatever the client writes
      tiers: [premium, standard]  # tier names it may use (absent: any tier)
      default_tier: standard    # the tier of a request naming none (needed with tiers)

Imports neither the engine nor torch (the router's image has neither).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Generic, TypeVar

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from iterserve.openai_http import APIError, bearer_credentials

logger = logging.getLogger("iterserve.credentials")

# Set by the router on every request it forwards with the router token; honoured by a server
# only on requests bearing that token (client-sent values are stripped or ignored).
TENANT_HEADER = "x-tenant-id"
TIERS_HEADER = "x-iterserve-tiers"  # JSON list of the tier names the caller's key may use
DEFAULT_TIER_HEADER = "x-iterserve-default-tier"  # the tier of a request naming none
TRUSTED_HEADERS = frozenset((TENANT_HEADER, TIERS_HEADER, DEFAULT_TIER_HEADER))
# A file is stat'ed at most this often (seconds): a request costs no syscall most of the time,
# and a rotated Secret is in force within a second of kubelet swapping it in.
CHECK_INTERVAL_S = 1.0
MAX_TENANT_LEN = 256

T = TypeVar("T")


class CredentialsError(ValueError):
    """A credentials file that cannot be used (the message names the file and the entry)."""


# ----------------------------------------------------------------- the keys file


def _printable(value: str) -> str:
    if any(unicodedata.category(c)[0] == "C" for c in value) or value != value.strip():
        raise ValueError("must be printable, without surrounding blanks")
    return value


Name = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TENANT_LEN)]


class ApiKeyEntry(BaseModel):
    """One entry of the keys file (the module docstring's shape)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    key: Annotated[str, StringConstraints(min_length=8, pattern=r"^[\x21-\x7e]+$")]
    tenant: Name
    tiers: list[Name] | None = Field(default=None, min_length=1)
    default_tier: Name | None = None

    @pydantic.field_validator("tenant", "default_tier")
    @classmethod
    def _check_printable(cls, value: str | None) -> str | None:
        return None if value is None else _printable(value)

    @pydantic.model_validator(mode="after")
    def _check_default_tier(self) -> ApiKeyEntry:
        if self.tiers is not None and self.default_tier is None:
            raise ValueError("default_tier is required with tiers (one of them)")
        if self.tiers is not None and self.default_tier not in self.tiers:
            raise ValueError(f"default_tier {self.default_tier!r} is not one of tiers")
        return self


_ENTRIES = pydantic.TypeAdapter(list[ApiKeyEntry])


@dataclass(frozen=True)
class Grant:
    """What a request may do: its tenant and the tiers it may use.

    Attributes:
        tenant: the request's tenant; None: as the request says (``X-Tenant-Id``, ``user``).
        tiers: tier names it may use; None: any tier.
        default_tier: the tier of a request naming none; None: the server's default.
    """

    tenant: str | None = None
    tiers: frozenset[str] | None = None
    default_tier: str | None = None

    def allows(self, tier: str) -> bool:
        return self.tiers is None or tier in self.tiers

    def trusted_headers(self) -> dict[str, str]:
        """The headers the router sends for this grant (:data:`TRUSTED_HEADERS`); JSON with
        ASCII escapes, so any tier name travels in a latin-1 header."""
        headers = {}
        if self.tenant is not None:
            headers[TENANT_HEADER] = self.tenant  # sent as UTF-8, read so by the server
        if self.tiers is not None:
            headers[TIERS_HEADER] = json.dumps(sorted(self.tiers))
        if self.default_tier is not None:
            headers[DEFAULT_TIER_HEADER] = json.dumps(self.default_tier)
        return headers

    @classmethod
    def from_trusted_headers(cls, tiers: str | None, default_tier: str | None) -> Grant:
        """The tiers of a request the router forwarded (tenant: as the request says).

        Raises:
            CredentialsError: a header that is not what :meth:`trusted_headers` writes.
        """
        try:
            names = None if tiers is None else json.loads(tiers)
            default = None if default_tier is None else json.loads(default_tier)
        except ValueError as e:
            raise CredentialsError(f"malformed tier header: {e}") from e
        except RecursionError:  # nested past the recursion limit: not the router's JSON
            raise CredentialsError("malformed tier header: nested too deeply") from None
        if names is not None and not (
            isinstance(names, list) and all(isinstance(n, str) for n in names)
        ):
            raise CredentialsError(f"{TIERS_HEADER} is not a JSON list of names")
        if default is not None and not isinstance(default, str):
            raise CredentialsError(f"{DEFAULT_TIER_HEADER} is not a JSON string")
        return cls(None, None if names is None else frozenset(names), default)


def tier_not_allowed(tier: str, grant: Grant) -> APIError:
    """The 403 for a request asking for a tier its key may not use."""
    allowed = sorted(grant.tiers or ())
    return APIError(
        403,
        f"this API key may not use tier {tier!r} (its tiers: {allowed})",
        type="permission_error",
        param="priority",
        code="tier_not_allowed",
    )


def _digest(key: bytes) -> bytes:
    # Looked up by digest: a dict lookup on the key itself would leak its prefix in timing.
    return hashlib.sha256(key).digest()


class ApiKeys:
    """The keys of a keys file and their grants."""

    def __init__(self, entries: Iterable[ApiKeyEntry]) -> None:
        self.grants = {
            _digest(e.key.encode()): Grant(
                e.tenant, None if e.tiers is None else frozenset(e.tiers), e.default_tier
            )
            for e in entries
        }

    def __len__(self) -> int:
        return len(self.grants)

    def grant_for(self, authorization: bytes) -> Grant | None:
        """The grant of an ``Authorization`` header value ``Bearer <key>``; None for no key
        or one not in the file."""
        key = bearer_credentials(authorization)
        return None if not key else self.grants.get(_digest(key))


class _KeysLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """``yaml.SafeLoader`` refusing a field given twice in one entry (PyYAML keeps the last
    silently: an entry's second ``key:`` would hide its first); libyaml's when PyYAML has it
    (a re-read runs on the event loop: the pure-Python loader is about 5 times slower)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *entry``: merged by super
                continue
            name = self.construct_object(key_node, deep=deep)
            if not isinstance(name, str | int | float | bool):
                continue  # unhashable: super refuses it
            if name in seen:
                field = name if name in ApiKeyEntry.model_fields else "a field"
                raise yaml.constructor.ConstructorError(
                    None, None, f"{field} given twice in one entry", key_node.start_mark
                )
            seen.add(name)
        return super().construct_mapping(node, deep)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error without the file's text: PyYAML's message quotes the line it failed on,
    which may hold a key (a key is never printed). Quoted names (aliases, tags) are dropped
    too; single characters and ``<stream end>``-like tokens are kept."""
    if isinstance(e, yaml.reader.ReaderError):
        return f"not UTF-8 or UTF-16 text ({e.reason}) at byte {e.position}"
    if not isinstance(e, yaml.MarkedYAMLError):
        return type(e).__name__
    said = ", ".join(part for part in (e.context, e.problem) if part) or "a syntax error"
    problem = re.sub(r"'(?!<)[^' ]{3,}'", "'...'", said)
    mark = e.problem_mark or e.context_mark
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark else problem


def parse_api_keys(data: bytes, path: str) -> ApiKeys:
    """A keys file's contents (the module docstring's shape).

    Raises:
        CredentialsError: not YAML, not a list of entries, an invalid entry (its index and
            field named; never the key itself) or a key given twice.
    """
    try:
        raw = yaml.load(data, Loader=_KeysLoader)  # a SafeLoader
    except yaml.YAMLError as e:
        raise CredentialsError(f"{path}: not YAML: {_yaml_problem(e)}") from None
    except RecursionError:
        raise CredentialsError(f"{path}: not YAML: nested too deeply") from None
    try:
        entries = _ENTRIES.validate_python(raw if raw is not None else [])
    except RecursionError:
        raise CredentialsError(f"{path}: nested too deeply") from None
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        loc = list(first["loc"])
        where = f"entry {loc[0]}" if loc and isinstance(loc[0], int) else "the file"
        # An unknown field is named only when it reads like a field's name: a key pasted
        # where a field belongs (``- {key: sk-a, tenant: t, sk-b: x}``) is never printed.
        field = ".".join(
            str(x) if isinstance(x, int) or re.fullmatch(r"[a-z_]{1,32}", x) else "a field"
            for x in loc[1:]
        )
        message = first["msg"].removeprefix("Value error, ")
        problem = f"{field}: {message}" if field else message
        raise CredentialsError(
            f"{path}: {where}: {problem} (a list of entries: key, tenant, tiers, default_tier)"
        ) from None
    seen: dict[str, int] = {}
    for idx, entry in enumerate(entries):
        if entry.key in seen:
            raise CredentialsError(f"{path}: entry {idx}: the key of entry {seen[entry.key]} again")
        seen[entry.key] = idx
    if not entries:
        raise CredentialsError(f"{path}: no key (every request would be refused)")
    return ApiKeys(entries)


def parse_tokens(data: bytes, path: str) -> tuple[str, ...]:
    """A token file's contents: one token per line, blank lines and surrounding blanks
    dropped, in order. The first is the one to send, every one is accepted: a rotation
    writes ``NEW\nOLD`` (or, where the sender reads the same file, ``OLD\nNEW`` first), so
    a request carrying either passes while the kubelet has not yet given every pod the new
    file (the admin token, docs/server.md; the router token, docs/kubernetes.md).

    Raises:
        CredentialsError: no token, not ASCII, or a line with blanks or control characters
            inside (no HTTP client can send such a token).
    """
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise CredentialsError(f"{path}: the token is not ASCII") from None
    tokens = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not tokens:
        raise CredentialsError(f"{path}: no token in it")
    for number, token in enumerate(tokens, 1):
        if any(not 0x21 <= ord(c) <= 0x7E for c in token):
            raise CredentialsError(
                f"{path}: token {number} has whitespace or control characters inside"
            )
    return tokens


# ----------------------------------------------------------------- files re-read on change


class WatchedFile(Generic[T]):
    """A file parsed at start and again when it changes.

    At most every ``check_interval_s`` (seconds, on ``clock``) :meth:`current` stats the file,
    following symlinks: a Kubernetes Secret volume swaps its ``..data`` link to a new
    directory, so the resolved file's identity (device, inode, size, mtime and ctime in ns)
    changes even though the path's link does not. A changed file is read and parsed; one that
    is missing or does not parse is logged and the last good contents stay in force.

    Raises:
        CredentialsError: at construction, the file cannot be read or parsed.
    """

    def __init__(
        self,
        path: str,
        parse: Callable[[bytes, str], T],
        check_interval_s: float = CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.parse = parse
        self.check_interval_s = check_interval_s
        self.clock = clock
        try:
            self.identity = self._identity()
            with open(path, "rb") as f:
                self.value = parse(f.read(), path)
        except OSError as e:
            raise CredentialsError(f"{path}: {e.strerror}") from e
        self.checked_at = clock()
        self.unreadable: str | None = None  # the error of the last failed read, if any

    def _identity(self) -> tuple[int, ...]:
        s = os.stat(self.path)
        return (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)

    def current(self) -> T:
        """The file's contents as last parsed successfully."""
        now = self.clock()
        if now - self.checked_at >= self.check_interval_s:
            self.checked_at = now
            self._reload()
        return self.value

    def _reload(self) -> None:
        try:
            identity = self._identity()
            if identity == self.identity:
                return
            with open(self.path, "rb") as f:
                data = f.read()
            self.identity = identity  # a bad version is logged once, not every second
            self.unreadable = None
            self.value = self.parse(data, self.path)
            logger.info("%s: re-read", self.path)
        except OSError as e:
            if str(e) != self.unreadable:  # logged once, not every second until it is back
                logger.error("%s: cannot be read (%s); keeping the last good version", self.path, e)
            self.unreadable = str(e)
            return
        except CredentialsError as e:
            logger.error("%s; keeping the last good version", e)


def watch_credentials(
    api_keys_file: str | None, router_token_file: str | None
) -> tuple[WatchedFile[ApiKeys] | None, WatchedFile[tuple[str, ...]] | None]:
    """The keys file and the router-token file, each read now and watched (None: not given).

    Raises:
        CredentialsError: a file that cannot be read or parsed.
    """
    keys = WatchedFile(api_keys_file, parse_api_keys) if api_keys_file else None
    token = WatchedFile(router_token_file, parse_tokens) if router_token_file else None
    return keys, token
