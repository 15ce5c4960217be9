"""The commands that read or change a store without an engine: stats, users, export, delete,
rekey."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from memoryos_gpu.sizes import size_text

from .options import (
    EXIT_ERROR,
    CLIError,
    UsageFailure,
    checked_store,
    engine_options,
    handle_errors,
    options_of,
    store_key,
)
from .output import (
    aligned_rows,
    echo_json,
    echo_utf8,
    is_terminal,
    iso_time,
    json_text,
    plural,
)
from .stores import (
    is_url,
    open_store_at,
    require_store,
    shard_dirs,
    shown,
    store_file,
    user_store,
)

if TYPE_CHECKING:
    from pydantic import SecretStr


#: A shard's assistants and its live entries of each assistant's knowledge: rows every shard
#: holds a copy of (``distributed/replicas.py``), counted once for a sharded store.
_ASSISTANTS_SQL = "SELECT assistant_id FROM assistants"
_ASSISTANT_KNOWLEDGE_SQL = (
    "SELECT owner_id, COUNT(*) FROM knowledge WHERE owner_kind = 'assistant' AND live = 1 "
    "GROUP BY owner_id"
)


def _store_stats(store: str, key: SecretStr | None, *, shard: bool = False) -> dict[str, Any]:
    """One store's stats; ``shard``: also its ``assistants`` (ids) and ``assistant_knowledge``
    (live entries by assistant), which :func:`_shard_totals` takes out to count copies once."""
    st = open_store_at(store, writer=False, key=key)
    try:
        st.refuse_if_damaged()  # counts read from the sound pages of a damaged file look fine
        size, log_size = (st.size_bytes(), 0) if is_url(store) else _file_bytes(store)
        out = {
            # as given (a directory, a file, a masked URL), as users and ingest name it
            "store": st.path if is_url(store) else str(store),
            "bytes": size + log_size,
            "log_bytes": log_size,
            "embedding_model": st.get_meta("embedding_model"),
            "schema_version": st.get_meta("schema_version"),
            "counts": st.counts(),
        }
        if shard:
            out["assistants"] = {a for (a,) in st.query(_ASSISTANTS_SQL)}
            out["assistant_knowledge"] = dict(st.query(_ASSISTANT_KNOWLEDGE_SQL))
        return out
    finally:
        st.close()


def _file_bytes(store: str) -> tuple[int, int]:
    """A SQLite store's bytes on disk: its database file's and its write-ahead log's
    (``memory.sqlite3-wal``, 0 when there is none). Why both: committed pages stay in the log
    until a checkpoint copies them into the file, so under a running server or right after an
    ingest the file alone under-reports the store (430 KB against a 1 MB log)."""
    path = store_file(store)
    wal = path.with_name(path.name + "-wal")
    try:
        log_size = wal.stat().st_size
    except FileNotFoundError:
        log_size = 0
    return path.stat().st_size, log_size


def _shard_totals(store: str, dirs: list[Path], key: SecretStr | None) -> dict[str, Any]:
    """A sharded store's stats: counts summed over the shards, except what every shard holds a
    copy of (``distributed/replicas.py``): the assistants, counted once each, and their live
    knowledge, counted from each assistant's owner shard (the writer; the replicas copy it).
    The embedding model as one store's (the shards agree), else None and the shards' own."""
    from memoryos_gpu.distributed.layout import ShardMap

    owner = ShardMap(len(dirs)).assistant_owner
    present = [(i, d) for i, d in enumerate(dirs) if store_file(d).exists()]
    shards = [_store_stats(str(d), key, shard=True) for _, d in present]
    totals: dict[str, int] = {}
    for s in shards:
        for k, v in s["counts"].items():
            totals[k] = totals.get(k, 0) + v
    names = set().union(*(s.pop("assistants") for s in shards))
    held = {i: s.pop("assistant_knowledge") for (i, _), s in zip(present, shards, strict=True)}
    if shards:
        totals["assistants"] = len(names)
        copies = sum(n for by in held.values() for n in by.values())
        once = 0
        for a in set().union(*held.values()):
            counts = {i: by.get(a, 0) for i, by in held.items()}
            once += counts.get(owner(a), max(counts.values()))
        totals["knowledge_live"] = totals.get("knowledge_live", 0) - copies + once
    models = sorted({str(s["embedding_model"]) for s in shards})
    versions = {s["schema_version"] for s in shards}
    return {
        "store": store,
        "embedding_model": models[0] if len(models) == 1 else None,
        "schema_version": versions.pop() if len(versions) == 1 else None,
        "shards": shards,
        "counts": totals,
        "bytes": sum(s["bytes"] for s in shards),
        "log_bytes": sum(s["log_bytes"] for s in shards),
    }


@click.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object: counts, size, model.")
@engine_options
@click.pass_context
@handle_errors
def stats(ctx: click.Context, as_json: bool, **kwargs: Any) -> None:
    """What the store holds: users, pages per tier, segments, knowledge, pending work."""
    o = options_of(ctx, kwargs)
    store, key = checked_store(o), store_key(o)
    dirs = shard_dirs(store) if not store_file(store).exists() else None
    data = _shard_totals(store, dirs, key) if dirs else _store_stats(store, key)
    c = data["counts"]
    data["pages"] = sum(v for k, v in c.items() if k.startswith("pages_"))
    data["users"] = c.get("users", 0)
    if as_json:
        echo_json(data)
        return
    tiers = ", ".join(f"{k[6:]} {v:,}" for k, v in sorted(c.items()) if k.startswith("pages_"))
    shards = f", {plural(len(data['shards']), 'shard')}" if "shards" in data else ""
    log_size = data["log_bytes"]
    size = size_text(data["bytes"] - log_size) + (
        f" + {size_text(log_size)} log" if log_size else ""
    )
    rows = [("store", f"{data['store']} ({size}{shards})")]
    models = sorted({str(s["embedding_model"]) for s in data.get("shards", [data])})
    if len(models) == 1:
        rows.append(("embeddings", models[0]))
    elif models:  # shards that disagree: each one's
        each = ", ".join(f"{s['store']} {s['embedding_model']}" for s in data["shards"])
        rows.append(("embeddings", f"the shards disagree: {each}"))
    rows += [
        ("users", f"{data['users']:,}"),
        ("pages", f"{data['pages']:,}" + (f" ({tiers})" if tiers else "")),
        *((key, f"{c.get(key, 0):,}") for key in ("segments", "knowledge_live", "assistants")),
        ("pending", f"{c.get('pending', 0):,}"),
    ]
    for line in aligned_rows(rows):
        click.echo(line)


#: The users of a store with their assistant, newest page time (``users.clock``: the newest
#: page timestamp the user's memory took, which a deleted page's keeps) and page count: one
#: statement, the counts from the index on ``pages(user_id, ...)``, in first-seen order.
_USERS_SQL = (
    "SELECT users.user_id, users.assistant_id, users.clock, COALESCE(n.n_pages, 0) FROM users "
    "LEFT JOIN (SELECT user_id, COUNT(*) AS n_pages FROM pages GROUP BY user_id) n "
    "ON n.user_id = users.user_id ORDER BY users.rowid"
)


def _store_users(store: str, key: SecretStr | None) -> list[dict[str, Any]]:
    st = open_store_at(store, writer=False, key=key)
    try:
        rows = st.query(_USERS_SQL)
    finally:
        st.close()
    return [
        {
            "user_id": user_id,
            "assistant_id": assistant_id,
            "pages": int(pages),
            "last_timestamp": float(clock) if pages else None,
            "last_time": iso_time(clock) if pages else None,
        }
        for user_id, assistant_id, clock, pages in rows
    ]


@click.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object: the users and their pages.")
@engine_options
@click.pass_context
@handle_errors
def users(ctx: click.Context, as_json: bool, **kwargs: Any) -> None:
    """The store's users: id, assistant, pages and newest page time, in the order they were
    first seen; the ids `export --user` takes (generated `conv-...` ids included). Reads
    beside a running server or ingest."""
    o = options_of(ctx, kwargs)
    store, key = checked_store(o), store_key(o)
    dirs = shard_dirs(store) if not store_file(store).exists() else None
    if dirs:
        rows = [
            {**row, "shard": i}
            for i, d in enumerate(dirs)
            if store_file(d).exists()
            for row in _store_users(str(d), key)
        ]
    else:
        rows = _store_users(store, key)
    if as_json:
        echo_json({"store": shown(store), "count": len(rows), "users": rows})
        return
    if not rows:
        click.echo(f"no users in {shown(store)}")
        return
    table = [("user", "assistant", "pages", "newest page")] + [
        (r["user_id"], str(r["assistant_id"]), f"{r['pages']:,}", r["last_time"] or "-")
        for r in rows
    ]
    for line in aligned_rows(table, right=frozenset({2})):
        click.echo(line)
    click.echo(plural(len(rows), "user"), err=True)


# ============================================================================ export / delete
@click.command()
@click.option("--user", "user_id", required=True, help="The user whose memory is exported.")
@click.option(
    "--out",
    "out_path",
    metavar="FILE",
    callback=lambda _ctx, _param, value: _out_path(value),
    help="Write the JSON to FILE (whole or not at all; a symbolic link is followed) instead "
    "of stdout; - is stdout.",
)
@engine_options
@click.pass_context
@handle_errors
def export(ctx: click.Context, user_id: str, out_path: str | None, **kwargs: Any) -> None:
    """Everything held about a user (pages, segments, profile, knowledge, audit) as JSON; `ingest`
    reads it back (its pages) into another store (docs/formats.md, export)."""
    from memoryos_gpu.formats.exports import EXPORT_FORMAT, EXPORT_VERSION

    o = options_of(ctx, kwargs)
    st = open_store_at(user_store(checked_store(o), user_id), writer=False, key=store_key(o))
    try:
        found = st.export_user(user_id)
        if found is None:
            raise CLIError(f"unknown user {user_id!r}")
        # the marker first: what `ingest` recognises an export by (formats/exports.py)
        data = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, **found}
        data["assistant_knowledge"] = st.owner_knowledge("assistant", data["user"]["assistant_id"])
    finally:
        st.close()
    text = json_text(data, indent=2)
    if out_path is None:
        echo_utf8(text)  # UTF-8 whatever the locale, as --out writes it
        return
    _write_whole(Path(out_path), text + "\n")
    click.echo(f"exported {user_id}: {plural(len(data['pages']), 'page')} -> {out_path}", err=True)


def _out_path(value: str | None) -> str | None:
    """``export --out``'s file: None for stdout (not given, or ``-``, the usual name for it).
    An empty value is refused before the store is opened: it is what an unset variable
    expands to (``--out "$FILE"``), and taking it for "not given" sent the export to stdout
    while the script meant a file."""
    if value is None or value == "-":
        return None
    if not value.strip():
        raise UsageFailure("--out is empty: give a file name, or - for stdout")
    return value


def _write_whole(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: into a temporary file beside the file
    ``path`` names (its links followed), renamed over that file once written and flushed.
    Why: written in place, a failure part way (a full disk, a string no UTF-8 encodes) left an
    empty or cut file where the export was asked for, and a file there before was lost. A lone
    surrogate that a store holds from before the engine replaced them is written as its JSON
    escape (``\\ud800``), as the server does.

    A symbolic link is followed, never replaced: renaming over the link itself destroyed it
    and left its target unwritten (with ``/dev/stdout`` redirected to a file, it replaced the
    system's ``/dev/stdout``). A path that leads to an open file descriptor (``/dev/stdout``,
    ``/dev/fd/N``, ``/proc/self/fd/N``) or to something that is not a regular file (a device,
    a pipe) is written as it is, without a temporary file; a file replaced keeps its
    permissions. An error names ``path`` as given, not the temporary file."""
    try:
        if _names_open_fd(str(path)):  # appended: what the stream holds already stays
            _write_as_is(str(path), text, "a")
            return
        real = Path(os.path.realpath(path))
        try:
            mode: int | None = os.stat(real).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not stat.S_ISREG(mode):
            _write_as_is(str(real), text, "w")
            return
        _replace_atomically(real, text, mode)
    except OSError as exc:
        raise CLIError(f"cannot write {path}: {exc.strerror or exc}") from None


#: ``/proc/<pid>/fd`` (or a thread's): its entries are links to a process's open files, which
#: ``/dev/stdout`` and ``/dev/fd/N`` lead to.
_FD_DIR = re.compile(r"/proc/[^/]+(/task/[^/]+)?/fd")


def _names_open_fd(path: str) -> bool:
    """Whether ``path``, its links followed one at a time, passes through an entry of a
    ``/proc/<pid>/fd`` directory. Why not ``os.path.realpath``: such an entry resolves to a
    name that is not a path (``pipe:[1234]``, ``/x/log (deleted)``), or to the file an earlier
    redirection opened, whose content a rename would not keep."""
    p = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on links followed
        if _FD_DIR.fullmatch(os.path.realpath(os.path.dirname(p))):
            return True
        if not os.path.islink(p):
            return False
        p = os.path.join(os.path.dirname(p), os.readlink(p))
    return False


def _write_as_is(path: str, text: str, how: str) -> None:
    """Write ``text`` to ``path`` opened as it is (``how``: "w" or "a"): no temporary file,
    which a device, a pipe or an open descriptor cannot be renamed over."""
    with open(path, how, encoding="utf-8", errors="backslashreplace") as f:
        f.write(text)


def _replace_atomically(real: Path, text: str, mode: int | None) -> None:
    """Write ``text`` into a temporary file beside ``real`` (a path without links), flushed,
    then renamed over ``real``, which keeps its permissions (``mode``; None: a new file,
    readable by its owner only, as the store is: an export holds a user's whole memory,
    decrypted when the store is encrypted)."""
    tmp = real.with_name(f".{real.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "w", encoding="utf-8", errors="backslashreplace") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, stat.S_IMODE(mode))
        os.replace(tmp, real)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _forget_on_other_shards(
    store: str, home: Any, user_id: str, pages: list[tuple[int, str]], key: SecretStr | None
) -> None:
    """A sharded store directory: the assistant facts the user's pages taught, held by the
    assistants' owner shards and copied to every shard, go from every shard's store too, and
    the other shards' saved keyword statistics un-count those of the user's ``pages`` (page
    id, text) the keyword exchange gave them: none on shards that never exchanged
    (``distributed/sharded_forget.py``). Run before the user's own rows go from ``home`` (its
    shard's store, open): a delete stopped part way still finds the user, and its re-run
    finishes every shard (each un-counts a user's pages once: ``forget_in_stores``)."""
    from memoryos_gpu.distributed.layout import ShardMap
    from memoryos_gpu.distributed.sharded_forget import forget_in_stores

    dirs = None if is_url(store) or store_file(store).exists() else shard_dirs(store)
    if not dirs:
        return
    mine = user_store(store, user_id)
    opened: list[Any] = []
    try:
        stores = []
        for d in dirs:
            if str(d) == mine:
                stores.append(home)
            else:
                opened.append(_one_shot(open_store_at(str(d), writer=True, key=key)))
                opened[-1].refuse_if_damaged()  # every shard checked before any is written
                stores.append(opened[-1])
        ids, texts = [p for p, _ in pages], [t for _, t in pages]
        forget_in_stores(stores, ShardMap(len(dirs)), user_id, texts, ids)
    finally:
        for st in opened:
            st.close()


@click.command()
@click.option("--user", "user_id", required=True, help="The user to delete, with all it taught.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@engine_options
@click.pass_context
@handle_errors
def delete(ctx: click.Context, user_id: str, yes: bool, **kwargs: Any) -> None:
    """Delete every row held about a user (pages, segments, knowledge, pending work, audit) and
    what was derived from the user's pages (the assistant's facts learned from them, the saved
    keyword statistics; on a sharded store directory, on every shard); the audit keeps the
    deletion, without content. The user's rejected records go too from the rejects files
    `ingest` wrote in the store's folder (STORE/rejects.jsonl, STORE/shard-*/rejects.jsonl; a
    --rejects FILE elsewhere is yours to delete). Asks for confirmation on a terminal; with
    stdin not a terminal (a script) it asks nothing and is refused without --yes. Refused
    while another process writes the store (a server: delete through its HTTP API)."""
    from memoryos_gpu.rejects import count_rejects

    o = options_of(ctx, kwargs)
    store, key = checked_store(o), store_key(o)
    _can_confirm(yes)
    st = _one_shot(open_store_at(user_store(store, user_id), writer=True, key=key))
    try:
        st.refuse_if_damaged()  # about the cost of the file's rewrite the deletion ends in
        rows = st.rows_about(user_id)
        known = st.user_row(user_id) is not None or rows > 0
        rejected = count_rejects(store, user_id)
        if not known and not rejected:
            raise CLIError(f"unknown user {user_id!r}")
        if not yes:
            what = f"{plural(rows, 'row')}, {plural(rejected, 'rejected record')}"
            click.confirm(f"delete user {user_id!r} ({what})?", abort=True, err=True)
        left = 0
        if known:
            _forget_on_other_shards(store, st, user_id, _user_pages(st, user_id), key)
            left = _delete_rows(st, user_id)
        rejected, failed = _forget_rejects(store, user_id)  # under the claim: no ingest writes
    finally:
        st.close()
    click.echo(
        f"deleted user {user_id}: {plural(rows, 'row')} removed"
        + (f" ({left} left!)" if left else "")
        + (
            f", {plural(rejected, 'rejected record')} removed from the rejects files"
            if rejected
            else ""
        )
    )
    if failed is not None:
        raise CLIError(
            f"a rejects file still holds {user_id!r}'s refused records: {failed}; "
            "fix that and run the delete again"
        )
    if left:
        ctx.exit(EXIT_ERROR)


def _can_confirm(yes: bool) -> None:
    """Refuse ``delete``'s confirmation prompt when stdin is not a terminal (unless ``yes``),
    before the store is opened. Why: the prompt read its answer from whatever stdin was, and
    in a loop over ids (``while read u; do delete --user "$u"; done < ids``) it took the next
    id for the answer, refused it and ended the loop after one pass; ``rekey`` refuses to
    prompt there likewise (:func:`_can_ask`)."""
    if yes or _stdin_is_terminal():
        return
    raise UsageFailure(
        "delete asks for confirmation, and stdin is not a terminal to ask on: "
        "give --yes (-y) to delete without asking"
    )


def _stdin_is_terminal() -> bool:
    """Whether a prompt can ask a person: stdin is a terminal (not a pipe, a file or closed)."""
    import sys

    return is_terminal(sys.stdin)


def _one_shot(st: Any) -> Any:
    """``st``, a store this command closes right after its deletion, before it exits: a SQLite
    store then completes its erasure at close, not on a timer that would never run
    (:attr:`~memoryos_gpu.store.erasure.SQLiteErasure.erase_at_close`)."""
    from memoryos_gpu.store.erasure import SQLiteErasure

    if isinstance(st, SQLiteErasure):
        st.erase_at_close = True
    return st


def _forget_rejects(store: str, user_id: str) -> tuple[int, OSError | None]:
    """The user's rows removed from the store folder's rejects files: ``(rows removed, the
    error that stopped it or None)``. An error is reported after the other shards' part of the
    deletion, not instead of it: the store's rows are gone by then."""
    from memoryos_gpu.rejects import forget_rejects

    try:
        return forget_rejects(store, user_id), None
    except OSError as exc:
        return 0, exc


def _user_pages(st: Any, user_id: str) -> list[tuple[int, str]]:
    """The user's pages' ids and texts, ascending: for the other shards' keyword statistics."""
    sql = (
        "SELECT page_id, user_input || ' ' || agent_response FROM pages WHERE user_id = ? "
        "ORDER BY page_id"
    )
    return [(int(p), t) for p, t in st.query(sql, (user_id,))]


def _delete_rows(st: Any, user_id: str) -> int:
    """Delete the user's rows from its store; returns the rows left (to check it worked)."""
    st.delete_user(user_id)
    return st.rows_about(user_id)


@click.command()
@click.option(
    "--encrypt",
    is_flag=True,
    help="Encrypt a store that is not encrypted yet, under $MEMORYOS_GPU_KEY (else the config "
    "file's encryption_key, else prompted). "
    "One way: there is no decrypt.",
)
@engine_options
@click.pass_context
@handle_errors
def rekey(ctx: click.Context, encrypt: bool, **kwargs: Any) -> None:
    """Change an encrypted store's key: the current key from $MEMORYOS_GPU_KEY (else the config
    file's encryption_key), the new one from
    $MEMORYOS_GPU_NEW_KEY (each prompted for, hidden, when unset). Every shard of a sharded
    store is rewritten; refused while another process writes it. --encrypt also rewrites the
    store's default rejects files without the records' content. See docs/storage.md."""
    from pydantic import SecretStr

    from memoryos_gpu.rejects import encrypt_rejects
    from memoryos_gpu.stop_signals import StopSignals
    from memoryos_gpu.store.encryption import (
        ENV_NEW_KEY,
        AlreadyEncryptedError,
        RekeyInterrupted,
        env_key,
        rekey_all,
    )

    o = options_of(ctx, kwargs)
    store, key = checked_store(o), store_key(o)
    if is_url(store):
        raise CLIError("rekey applies to SQLite stores (a PostgreSQL server encrypts by itself)")
    files = [store_file(d) for d in shard_dirs(store) or [store]]
    for f in files:
        require_store(str(f))

    def ask(what: str, confirm: bool = False) -> SecretStr:
        _can_ask(what, encrypt)
        return SecretStr(click.prompt(what, hide_input=True, confirmation_prompt=confirm, err=True))

    new = key if encrypt else env_key(ENV_NEW_KEY)  # checked before any prompt
    old = None if encrypt else key or ask("current key")
    if not encrypt and new is not None and new.get_secret_value() == old.get_secret_value():
        raise CLIError(f"${ENV_NEW_KEY} is the current key: nothing to change")
    new = new or ask("new key", confirm=True)
    # SIGTERM and SIGHUP (`timeout`, systemd, a closed terminal) stop it as Ctrl-C does: the
    # copy in flight is removed and the message says which key each file is under now
    stop = StopSignals(on_stop=_stop_now)
    try:
        with stop:
            done = rekey_all(list(files), old, new)
    except RekeyInterrupted as exc:
        sig = signal.Signals(stop.signum or signal.SIGINT)
        how = "" if sig == signal.SIGINT else f" ({sig.name})"
        click.echo(f"interrupted{how}: {exc.state}", err=True)
        raise click.exceptions.Exit(128 + int(sig)) from None
    except AlreadyEncryptedError:
        # every file is under this key already: an --encrypt killed after the store's rename
        # may have left plain rejects files beside it; finish that step, else nothing to do
        scrubbed = [(p, rows) for p, rows in encrypt_rejects(store, always=False) if rows != 0]
        if not scrubbed:
            raise
        click.echo(
            f"store under {store} already encrypted (under this key); finished what an "
            f"interrupted --encrypt left: {len(scrubbed)} rejects file(s) with plain records"
        )
        _said_rejects(scrubbed)
        return
    verb = "encrypted" if encrypt else "re-keyed"
    if not done:  # a rekey run again after it finished: every file has the new key already
        click.echo(f"every store file under {store} has the new key already: nothing re-keyed")
        return
    click.echo(f"{verb} {done} of {len(files)} store file(s) under {store}")
    if encrypt:  # the plain store's rejects files hold its records: not beside the encrypted one
        _said_rejects(encrypt_rejects(store))
    if not encrypt:
        click.echo(f"from now on open it with the new key (${ENV_NEW_KEY} -> $MEMORYOS_GPU_KEY)")


def _stop_now(signum: int) -> None:
    """``rekey``'s first stop signal: stop now, as Ctrl-C does (a copy cannot be half kept)."""
    raise KeyboardInterrupt


def _can_ask(what: str, encrypt: bool) -> None:
    """Refuse to prompt for ``rekey``'s ``what`` ("current key", "new key") when stdin is not
    a terminal: the hidden prompt would fall back to one that echoes the key (getpass's
    GetPassWarning), or read it from a pipe meant for something else."""
    from memoryos_gpu.store.encryption import ENV_KEY, ENV_NEW_KEY

    if _stdin_is_terminal():
        return
    where = f"${ENV_KEY} or the config file's encryption_key"
    if what == "new key" and not encrypt:
        where = f"${ENV_NEW_KEY}"
    raise CLIError(f"no {what} given, and stdin is not a terminal to ask for it: set {where}")


def _said_rejects(done: list[tuple[Path, int | None]]) -> None:
    """Say on stderr what ``rekey --encrypt`` did to each rejects file (encrypt_rejects)."""
    for path, rows in done:
        click.echo(
            f"removed {path}: not a rejects file throughout, and it could hold records in "
            "plain text"
            if rows is None
            else f"rewrote {path} without the records' content and users (where and why "
            "stay; as an encrypted store's ingest writes it)",
            err=True,
        )
