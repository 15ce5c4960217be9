"""What the commands print: JSON, the retrieval as text, the ingest summary table."""

from __future__ import annotations

import json
import math
import re
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click


def plural(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless n is 1 ("1 user", "5 pages", "1,024 rows"): what human
    output counts with ("1 users" read as a bug)."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` (stdin or stdout) is a terminal: a person to prompt, or to prompt
    on; False when it is None or closed (a pipe, a file, a daemon's stdin)."""
    try:
        return stream is not None and stream.isatty()
    except ValueError:  # a closed file
        return False


def console(*, stderr: bool = False) -> Any:
    """A rich Console that prints stored text as it is stored: no ``:smile:`` codes turned
    into emoji and no numbers, URLs or quotes recoloured (a memory or an id is data, and
    ``--json`` and ``export`` show it verbatim); markup in it is escaped where it is printed."""
    from rich.console import Console

    return Console(stderr=stderr, soft_wrap=True, emoji=False, highlight=False)


def echo_json(data: Any, indent: int | None = None) -> None:
    """``data`` as one JSON document on stdout (:func:`json_text`), in UTF-8 whatever the locale
    (:func:`echo_utf8`)."""
    echo_utf8(json_text(data, indent=indent))


def echo_utf8(text: str) -> None:
    """``text`` and a newline on stdout as UTF-8 bytes, whatever stdout's encoding. Why: JSON is
    UTF-8 (RFC 8259) and what reads it is a program, not the terminal; written through a
    stdout in GBK or Latin-1 (``PYTHONIOENCODING``, a legacy console) a character that
    encoding lacks (an emoji) failed the whole command, and the file ``export --out`` writes
    is UTF-8 already. A text-only stdout (no byte buffer: a ``StringIO``) takes the text."""
    if getattr(sys.stdout, "buffer", None) is None:
        click.echo(text)
        return
    click.echo(text.encode("utf-8", "backslashreplace"))


def aligned_rows(rows: list[tuple[str, ...]], right: frozenset[int] = frozenset()) -> list[str]:
    """``rows`` as lines of columns two spaces apart, each column padded to its widest cell in
    terminal columns (the last column unpadded; the columns in ``right`` aligned right). Why
    display width and not ``len``: a CJK character fills two columns, and padding by ``len``
    pushed every column after a Chinese user id out of line. The measure is rich's
    ``cell_len``, the one its tables (the ``ingest`` summary) pad by: one rule of width."""
    from rich.cells import cell_len

    if not rows:
        return []
    widths = [max(cell_len(row[c]) for row in rows) for c in range(len(rows[0]) - 1)]

    def cell(c: int, text: str) -> str:
        gap = " " * (widths[c] - cell_len(text))
        return gap + text if c in right else text + gap

    return ["  ".join([*(cell(c, t) for c, t in enumerate(row[:-1])), row[-1]]) for row in rows]


#: A lone surrogate (a store may hold one from before the engine replaced them with U+FFFD).
_SURROGATE = re.compile("[\ud800-\udfff]")


def json_text(data: Any, indent: int | None = None) -> str:
    """``data`` as strict JSON: a NaN or infinity (a mean over nothing, say) is ``null``, since
    ``json.dumps`` writes them as ``NaN``, which JSON parsers refuse, and never passes floats to
    ``default``; a lone surrogate is written as its escape (``\\ud800``, as the server's JSON
    does), since no UTF-8 encodes it and printing or writing the text would fail."""
    text = json.dumps(_finite(data), ensure_ascii=False, default=_default, indent=indent)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def _default(obj: Any) -> Any:
    """What ``json.dumps`` cannot write itself: arrays, paths, sets; anything else as text."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, set | frozenset):
        return sorted(obj)
    return str(obj)


def iso_time(ts: float | None) -> str | None:
    if ts is None:
        return None
    try:
        return datetime.fromtimestamp(float(ts), UTC).isoformat().replace("+00:00", "Z")
    except (OverflowError, OSError, ValueError):
        return None


#: What ``profile`` and ``retrieve`` say of an empty profile in extractive mode, where no stage
#: writes one (an empty profile there is not a failure).
NO_PROFILE_EXTRACTIVE = (
    "(none: profiles are written by the LLM stages, which extractive mode skips; "
    "ingest with --llm-mode llm)"
)


def page_sides(p: Any) -> list[tuple[str, str]]:
    """A page's (speaker, text) sides, each under its speaker's name when the log names them
    (LoCoMo: the two people; else User/Assistant), a side that said nothing left out: the one
    rendering of a page that ``retrieve``'s text output and its ``--json`` ``text`` share."""
    from memoryos_gpu.engine.page_text import speakers

    sides = zip(speakers(p.extra), (p.user_input, p.agent_response), strict=True)
    return [(name, said) for name, said in sides if said]


def page_json(p: Any) -> dict[str, Any]:
    return {
        "page_id": p.page_id,
        "text": "\n".join(f"{name}: {said}" for name, said in page_sides(p)),
        "user_input": p.user_input,
        "agent_response": p.agent_response,
        "timestamp": p.timestamp,
        "time": iso_time(p.timestamp),
        "score": p.score,
        "tier": p.tier,
        "meta": p.meta,
        "extra": p.extra,
    }


def retrieval_json(r: Any) -> dict[str, Any]:
    """A :class:`~memoryos_gpu.types.Retrieval` as the ``retrieve --json`` object."""
    return {
        "user_id": r.user_id,
        "query": r.query,
        "pages": [page_json(p) for p in r.all_pages()],
        "profile": r.profile,
        "knowledge": {
            "user": [
                {"entry_id": e.entry_id, "text": e.text, "score": e.score} for e in r.user_knowledge
            ],
            "assistant": [
                {"entry_id": e.entry_id, "text": e.text, "score": e.score}
                for e in r.assistant_knowledge
            ],
        },
        "retrieval_tokens": r.retrieval_tokens,
    }


def print_retrieval(r: Any, *, extractive: bool = False) -> None:
    """The retrieval as text. ``extractive``: the engine runs no LLM, so an empty profile is
    explained (one line) instead of left out, which reads as a failure."""
    from rich.markup import escape

    c = console()
    c.print(
        f"[bold]user[/] {escape(r.user_id)}  [bold]query[/] {escape(r.query)}  "
        f"(~{plural(r.retrieval_tokens, 'token')} of context)"
    )
    if r.profile:
        c.print("[bold]profile[/]")
        for k, v in r.profile.items():
            c.print(f"  {escape(str(k))}: {escape(str(v))}")
    elif extractive:
        c.print(f"[bold]profile[/] {escape(NO_PROFILE_EXTRACTIVE)}")
    for title, pages in (
        ("mid-term pages (best first; score: cosine and BM25 standardised, summed)", r.pages),
        (
            "short-term memory (the latest pages, in the order they were added; pages still "
            "waiting for derived work, if any, first)",
            r.stm,
        ),
    ):
        c.print(f"[bold]{title}[/] ({len(pages)})")
        for p in pages:
            score = f"{p.score:.3f} " if p.score is not None else ""
            c.print(f"  [dim]{score}{iso_time(p.timestamp) or ''}[/]")
            for name, said in page_sides(p):
                c.print(f"    {escape(name)}: {escape(said)}")
            if p.meta:
                c.print(f"    [dim]chain: {escape(p.meta)}[/]")
    for title, entries in (
        ("user knowledge", r.user_knowledge),
        ("assistant knowledge", r.assistant_knowledge),
    ):
        if entries:
            c.print(f"[bold]{title}[/]")
            for e in entries:
                c.print(f"  - {escape(e.text)}")


#: what the ingest summary's status says for each ``derived_failure``
_FAILED_BECAUSE = {
    "disk_full": "the disk is full",
    "store_error": "the store failed",
    "llm_unavailable": "the LLM could not be used",
}


#: How many reject kinds the summary table lists (the most frequent; --json has them all).
_SHOWN_REJECT_KINDS = 5


def _reject_kind_rows(reasons: dict[str, int]) -> list[tuple[str, str]]:
    """The summary's rows of reject kinds: the most frequent ones, then, when there are more,
    one row saying how many kinds and rejects are left out and where they all are, so that a
    person does not take the listed ones for every reason the input was refused for."""
    kinds = sorted(reasons.items(), key=lambda kv: -kv[1])
    rows = [(f"  {n:,} x", reason) for reason, n in kinds[:_SHOWN_REJECT_KINDS]]
    rest = kinds[_SHOWN_REJECT_KINDS:]
    if rest:
        left = sum(n for _, n in rest)
        rows.append(
            (
                "  ...",
                f"and {len(rest):,} more kind{'s' if len(rest) > 1 else ''} "
                f"({left:,} reject{'s' if left > 1 else ''}): see --json reject_reasons "
                "or the rejects file",
            )
        )
    return rows


def print_ingest_summary(r: dict[str, Any], *, err: bool) -> None:
    from rich.table import Table

    table = Table(title="ingest summary", show_header=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("")
    if r["interrupted"]:
        status = "interrupted (resume by running the same command again)"
    elif r.get("derived_failure"):
        why = _FAILED_BECAUSE.get(r["derived_failure"], "the store failed")
        status = f"derived work failed: {why} (it stays pending)"
    else:
        status = "done"
    rows = [
        ("status", status),
        ("accepted pages", f"{r['accepted']:,}"),
        ("already present (skipped)", f"{r['skipped']:,}"),
        ("rejected", f"{r['rejected']:,}"),
        ("users", f"{r['users']:,}"),
        ("elapsed", f"{r['elapsed_s']:.1f} s"),
        ("throughput", f"{r['pages_per_s']:,.1f} pages/s"),
        ("LLM calls", f"{r['llm_calls']:,}"),
        ("derived work pending", f"{r['pending']:,}"),
        ("store", str(r.get("store"))),
    ]
    if r.get("shard"):
        rows.append(("shard", r["shard"]))
    if r.get("other_shards"):
        rows.append(("records of other shards", f"{r['other_shards']:,}"))
    if r["rejected"]:
        rows.append(("rejects file", str(r.get("rejects_path"))))
        rows.extend(_reject_kind_rows(r.get("reject_reasons", {})))
    for name, value in rows:
        table.add_row(name, value)
    for s in r.get("shards", []):
        table.add_row(
            f"  shard {s.get('shard')}",
            f"{s.get('accepted', 0):,} accepted, {s.get('skipped', 0):,} present, "
            f"{s.get('rejected', 0):,} rejected, {plural(s.get('users', 0), 'user')}, "
            f"{s.get('pages_per_s', 0):,.1f} pages/s, exit {s.get('exit_code')}",
        )
    console(stderr=err).print(table)
