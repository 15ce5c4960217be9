"""API keys -> tenants, and token-bucket rate limits per key (requests, pages, bytes).

Keys come from a file (one ``KEY TENANT`` pair per line, ``#`` comments and blank lines
ignored) and/or the ``MEMORYOS_GPU_API_KEYS`` environment variable
(``"key1:tenant1,key2:tenant2"``). Keys are kept only as SHA-256 digests and are never logged;
logs and metrics name a key by a short fingerprint of its digest.

The tenant ``*`` (:data:`ADMIN`) marks an admin key: it reads the server-wide totals of
``/v1/stats`` and nothing else (no tenant's memory), so an operator's dashboard never needs a
tenant's key and a tenant's key never shows other tenants' load.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_VAR = "MEMORYOS_GPU_API_KEYS"
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MIN_KEY_CHARS = 8
ADMIN = "*"  # the tenant of admin keys


class KeyFileError(ValueError):
    """An API key file or variable is malformed (the message names the line, never the key)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def fingerprint(key: str) -> str:
    """A short, non-reversible name for a key (safe to log)."""
    return hashlib.sha256(b"fp:" + _digest(key)).hexdigest()[:10]


def _check(key: str, tenant: str, where: str, fmt: str = "KEY TENANT") -> None:
    # The messages never quote the rejected values: with the columns swapped, the "tenant"
    # is the key.
    if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
        raise KeyFileError(
            f"{where}: a key must be >= {MIN_KEY_CHARS} non-space characters "
            f"(the format is {fmt!r}, key first)"
        )
    if tenant != ADMIN and not TENANT_RE.match(tenant):
        raise KeyFileError(
            f"{where}: the tenant must match {TENANT_RE.pattern} (letters, digits, _ . -) or be "
            f"'{ADMIN}'; are the columns swapped? The format is {fmt!r}, key first"
        )


_Entry = tuple[str, str, str]  # (key, tenant, where)


def _read_key_file(path: str | Path) -> str:
    """The key file's text. Not UTF-8 is a :class:`KeyFileError` naming the file and line like
    every other key-file problem (a bare codec error names neither, and quotes a byte of what
    may be a key)."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise KeyFileError(
            f"{path}:{line}: not UTF-8 text; save the key file as UTF-8 "
            "(one 'KEY TENANT' pair per line)"
        ) from None


def _file_entries(path: str | Path) -> list[_Entry]:
    out: list[_Entry] = []
    for n, raw in enumerate(_read_key_file(path).splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise KeyFileError(f"{path}:{n}: expected 'KEY TENANT', got {len(parts)} fields")
        _check(parts[0], parts[1], f"{path}:{n}")
        out.append((parts[0], parts[1], f"{path}:{n}"))
    return out


def _env_entries(value: str) -> list[_Entry]:
    out: list[_Entry] = []
    for n, item in enumerate(value.split(","), 1):
        item = item.strip()
        if not item:
            continue
        key, sep, tenant = item.rpartition(":")
        if not sep:
            raise KeyFileError(f"{ENV_VAR} entry {n}: expected 'KEY:TENANT'")
        key, tenant = key.strip(), tenant.strip()
        _check(key, tenant, f"{ENV_VAR} entry {n}", fmt="KEY:TENANT")
        out.append((key, tenant, f"{ENV_VAR} entry {n}"))
    return out


def _merge(entries: list[_Entry]) -> dict[str, str]:
    """{key: tenant}; a key given twice must name the same tenant both times."""
    out: dict[str, str] = {}
    seen: dict[str, str] = {}  # key -> where it was first given
    for key, tenant, where in entries:
        if key in out and out[key] != tenant:
            raise KeyFileError(
                f"{seen[key]} and {where} give the same key (fingerprint {fingerprint(key)}) "
                "to two different tenants; a key belongs to one tenant"
            )
        out[key] = tenant
        seen.setdefault(key, where)
    return out


def parse_key_file(path: str | Path) -> dict[str, str]:
    """``KEY TENANT`` per line -> {key: tenant}."""
    return _merge(_file_entries(path))


def parse_key_env(value: str) -> dict[str, str]:
    """``"key1:tenant1,key2:tenant2"`` -> {key: tenant}."""
    return _merge(_env_entries(value))


def load_api_keys(
    api_keys: Mapping[str, str] | str | Path | None = None, *, use_env: bool = True
) -> dict[str, str] | None:
    """Merge keys from a mapping or file path and the environment; ``None`` when no source is
    configured at all (the server then runs open, single tenant).

    A configured source that holds no key (a file of comments and blank lines, an empty
    mapping, ``MEMORYOS_GPU_API_KEYS`` set but empty) is a :class:`KeyFileError`, never open
    mode; so is a key given to two different tenants (in one source or across them).
    """
    entries: list[_Entry] = []
    if isinstance(api_keys, str | Path):
        found = _file_entries(api_keys)
        if not found:
            raise KeyFileError(
                f"{api_keys}: the API key file holds no key (only comments or blank lines); "
                "refusing to run without authentication: add 'KEY TENANT' lines, or leave out "
                "the key file to run open"
            )
        entries += found
    elif api_keys is not None:
        if not api_keys:
            raise KeyFileError(
                "api_keys: no key given (an empty mapping); refusing to run without "
                "authentication: pass None to run open"
            )
        for n, (k, t) in enumerate(api_keys.items(), 1):
            _check(k, t, f"api_keys entry {n}")
            entries.append((k, t, f"api_keys entry {n}"))
    if use_env and ENV_VAR in os.environ:
        found = _env_entries(os.environ[ENV_VAR])
        if not found:
            raise KeyFileError(
                f"{ENV_VAR} is set but holds no key; refusing to run without authentication: "
                "give 'KEY:TENANT' pairs, or unset it to run open"
            )
        entries += found
    if not entries:
        return None
    return _merge(entries)


@dataclass(frozen=True)
class Principal:
    """Who a request acts for: a tenant (``None`` in open mode) and the key's fingerprint."""

    tenant: str | None
    key_id: str

    @property
    def admin(self) -> bool:
        return self.tenant == ADMIN


class KeyRing:
    """Constant-time lookup of a presented key (digest compare against every known digest)."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        self._entries = [(_digest(k), t, fingerprint(k)) for k, t in keys.items()]

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def key_ids(self) -> list[str]:
        """The keys' fingerprints (what the rate limits count by)."""
        return [fp for _, _, fp in self._entries]

    @property
    def tenants(self) -> set[str]:
        return {t for _, t, _ in self._entries if t != ADMIN}

    def lookup(self, presented: str) -> Principal | None:
        d = _digest(presented)
        found = None
        for digest, tenant, fp in self._entries:  # no early exit: timing does not leak which
            if hmac.compare_digest(d, digest):
                found = Principal(tenant, fp)
        return found


class RateLimiter:
    """Token bucket per key: ``rate`` tokens/s, ``burst`` capacity. Thread-safe.

    At most ``max_keys`` buckets are kept: past that, the full ones (the same as no bucket) are
    dropped, so keys a client makes up (addresses, guessed tokens) cannot grow it without end.
    """

    def __init__(self, rate: float, burst: int, max_keys: int = 100_000) -> None:
        self.rate, self.burst = float(rate), float(burst)
        self.max_keys = max_keys
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def _prune(self, now: float) -> None:
        full = [
            k
            for k, (t, last) in self._buckets.items()
            if t + (now - last) * self.rate >= self.burst
        ]
        for k in full:
            del self._buckets[k]

    def take(self, key_id: str, cost: float = 1.0) -> float:
        """0.0 when allowed, else the seconds until ``cost`` tokens are available (infinite
        when ``cost`` exceeds the bucket: it never will be)."""
        if self.rate <= 0:
            return 0.0
        if cost > self.burst:
            return math.inf
        now = time.monotonic()
        with self._lock:
            if len(self._buckets) >= self.max_keys and key_id not in self._buckets:
                self._prune(now)
            tokens, last = self._buckets.get(key_id, (self.burst, now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            if tokens >= cost:
                self._buckets[key_id] = (tokens - cost, now)
                return 0.0
            self._buckets[key_id] = (tokens, now)
            return (cost - tokens) / self.rate

    @staticmethod
    def retry_after(wait_s: float) -> int:
        return max(1, math.ceil(wait_s))


#: A refusal: (HTTP status, error code, message, headers).
Refusal = tuple[int, str, str, dict[str, str]]


class KeyLimits:
    """A key's three token buckets: requests, request-body bytes and written pages per second
    (and one per client address for unknown keys).

    Why three: a request count alone lets one key send the largest requests back to back (80
    pages of 100,000 characters each is one request); counting bytes and pages bounds the work
    a key can ask for, whatever its requests look like. A cost over a bucket's size can never
    be met and is refused with 413 instead of 429 (the settings keep each bucket at least as
    large as the biggest request the size limits allow).
    """

    def __init__(self, settings: Any) -> None:
        s = settings
        self.requests = RateLimiter(s.rate_limit_per_s, s.rate_limit_burst)
        self.bytes = RateLimiter(s.rate_limit_bytes_per_s, s.rate_limit_bytes_burst)
        self.pages = RateLimiter(s.rate_limit_pages_per_s, s.rate_limit_pages_burst)
        # per client address, for requests with an unknown key (guessing keys)
        self.unknown_keys = RateLimiter(s.auth_failures_per_s, s.auth_failures_burst)

    def request(self, key_id: str) -> Refusal | None:
        return _refusal(self.requests.take(key_id), "requests", 1, self.requests)

    def body(self, key_id: str, n_bytes: int) -> Refusal | None:
        return _refusal(self.bytes.take(key_id, n_bytes), "bytes", n_bytes, self.bytes)

    def written(self, key_id: str, n_pages: int) -> Refusal | None:
        return _refusal(self.pages.take(key_id, n_pages), "pages", n_pages, self.pages)


def _refusal(wait: float, unit: str, cost: float, bucket: RateLimiter) -> Refusal | None:
    if wait <= 0:
        return None
    if math.isinf(wait):
        return (
            413,
            "too_large",
            f"{cost:g} {unit} in one request; this key may send at most {bucket.burst:g} {unit} "
            f"at once ({bucket.rate:g} per second sustained)",
            {},
        )
    retry = RateLimiter.retry_after(wait)
    return (
        429,
        "rate_limited",
        f"rate limit of this key exceeded ({unit}: {bucket.rate:g} per second, bursts of "
        f"{bucket.burst:g}); retry in {retry} s",
        {"Retry-After": str(retry)},
    )
