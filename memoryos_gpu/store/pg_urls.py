"""A PostgreSQL store's URL: what libpq reads from it, and the form of it that messages and
logs may show (the password masked).

Why not ``urllib.parse``: a password holding an unencoded ``#``, ``/``, ``?`` or ``[`` ends its
``netloc`` early (nothing masked: the password printed in the clear) or raises (``Invalid IPv6
URL``). libpq takes the credentials up to the first ``@`` before any ``/``; these functions
read the URL the same way, and refuse one that libpq would read otherwise than written.
"""

from __future__ import annotations

from urllib.parse import unquote

from memoryos_gpu.store.errors import StoreError

__all__ = ["URL_SCHEMES", "check_url", "credentials_end", "redact"]

URL_SCHEMES = ("postgresql://", "postgres://")

_SECRET_PARAMS = ("password", "sslpassword")
_ENCODE_HINT = (
    "percent-encode special characters in the user name and password ('@' as %40, '/' as "
    "%2F, ':' as %3A, '#' as %23, '?' as %3F, '%' as %25)"
)


def credentials_end(url: str) -> int | None:
    """Where the user name and password of ``url`` end (the index of their ``@``) as libpq
    reads them, or None for a URL without credentials; -1 for one libpq would read otherwise
    than it was meant (a password holding an unencoded ``@`` or ``/``: an ``@`` left in the
    host or the database name)."""
    start = url.find("://") + 3
    rest = url[start:]
    slash = rest.find("/")
    at = rest.find("@", 0, len(rest) if slash < 0 else slash)  # libpq stops at the first '/'
    address = rest[at + 1 :].split("?", 1)[0]  # host[:port][/dbname], then the query
    if "@" in address:
        return -1
    return None if at < 0 else start + at


def redact(url: str) -> str:
    """``url`` with its password (in the authority or a ``password=`` parameter) masked, for
    messages and logs. Robust to passwords with unencoded special characters: where libpq
    would read the URL otherwise than written, everything between ``//`` and the URL's last
    ``@`` is masked."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = credentials_end(url)
    if end == -1:  # ambiguous: mask everything that could be the password
        last = rest.rfind("@")
        return f"{scheme}://***@{_mask_query(rest[last + 1 :])}"
    if end is None:
        return f"{scheme}://{_mask_query(rest)}"
    auth, tail = url[len(scheme) + 3 : end], url[end + 1 :]
    if ":" in auth:
        auth = auth.split(":", 1)[0] + ":***"
    return f"{scheme}://{auth}@{_mask_query(tail)}"


def _mask_query(text: str) -> str:
    """``host/db?query`` with the values of secret query parameters masked."""
    head, sep, query = text.partition("?")
    if not sep:
        return text
    pairs = []
    for pair in query.split("&"):
        key, eq, _value = pair.partition("=")
        pairs.append(f"{key}=***" if eq and unquote(key).lower() in _SECRET_PARAMS else pair)
    return f"{head}?{'&'.join(pairs)}"


def check_url(url: str) -> dict[str, str]:
    """The libpq parameters of ``url``; :class:`StoreError` (printing no password) for a URL
    libpq cannot parse or would read otherwise than written."""
    if credentials_end(url) == -1:
        raise StoreError(
            f"cannot read store URL {redact(url)}: its user name or password holds an '@' or "
            f"'/' that would be read as part of the address; {_ENCODE_HINT}"
        )
    import psycopg  # the postgres extra: only a store that connects parses its URL
    from psycopg.conninfo import conninfo_to_dict

    try:
        return conninfo_to_dict(url)
    except psycopg.Error:  # its words may quote the password
        raise StoreError(f"cannot parse store URL {redact(url)}: {_ENCODE_HINT}") from None
