"""The ``memoryos-gpu`` command line (also ``python -m memoryos_gpu``). See ``docs/cli.md``.

Settings are resolved per run with the precedence *command-line flag > environment variable >
config file (``--config FILE.toml``) > built-in default*. Engine options may be given before or
after the subcommand (``memoryos-gpu --store s ingest f.jsonl`` = ``memoryos-gpu ingest f.jsonl
--store s``); after the subcommand wins.

Environment variables read here:

* ``MEMORYOS_GPU_EMBEDDER`` = ``transformers`` (default: the bundled MiniLM) | ``hashing`` (a fast,
  deterministic, model-free test double; a store built with it can only be opened with it);
* ``MEMORYOS_GPU_STORE``: the default ``--store``;
* ``MEMORYOS_GPU_KEY``: the key of an encrypted store (every command); ``MEMORYOS_GPU_NEW_KEY``:
  the new key of ``rekey`` (docs/storage.md, "Encryption at rest").

Exit codes: 0 ok; 1 runtime error (unknown user, store problems, missing optional parts);
2 usage error (bad flag, missing file, undetectable format, bad config); 3 ``ingest``
finished but rejected some records; 130 interrupted (SIGINT), after a clean stop.
"""

from .app import cli, main

__all__ = ["cli", "main"]
