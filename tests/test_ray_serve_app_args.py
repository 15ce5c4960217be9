"""``ray_serve.app_builder`` (the ``import_path`` of ``serve run deploy/ray-serve.yaml``) takes
only the args it knows, and defaults ``shards`` as ``serve --ray`` does.

Why: it popped the names it knew and dropped the rest without a word, so ``api_key:`` for
``api_keys:`` in the YAML file started the service with no authentication (and
``sync_intervall_s`` was ignored); and its default of 1 shard differed from ``serve --ray``'s
"the store's shard count, else 2".

No Ray is started: ``build_app`` is replaced by a stub that records what it is given.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from memoryos_gpu.distributed import ray_serve
from memoryos_gpu.distributed.layout import prepare_layout

ROOT = Path(__file__).parents[1]


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What ``app_builder`` handed ``build_app`` (filled by the stub; empty if never called)."""
    seen: dict[str, Any] = {}

    def fake_build_app(config: Any, shards: int, **kw: Any) -> str:
        seen.update(config=config, shards=shards, **kw)
        return "APP"

    monkeypatch.setattr(ray_serve, "build_app", fake_build_app)
    monkeypatch.delenv("MEMORYOS_GPU_API_KEYS", raising=False)
    return seen


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("api_key", "api_keys"),
        ("sync_intervall_s", "sync_interval_s"),
        ("max_batchh", "max_batch"),  # a ServerSettings field
        ("shard", "shards"),
    ],
)
def test_unknown_arg_is_refused_naming_it(
    built: dict[str, Any], tmp_path: Path, typo: str, meant: str
) -> None:
    args = {"store": str(tmp_path / "s"), "shards": 2, "embedder": "hashing", typo: "x"}
    with pytest.raises(ValueError, match=rf"unknown arg '{typo}' \(did you mean '{meant}'\?\)"):
        ray_serve.app_builder(args)
    assert built == {}  # refused before anything was built


def test_every_unknown_arg_is_named_and_a_far_one_gets_no_guess(
    built: dict[str, Any], tmp_path: Path
) -> None:
    args = {"store": str(tmp_path / "s"), "api_key": "k.txt", "zzzzzz": 1}
    with pytest.raises(ValueError) as err:
        ray_serve.app_builder(args)
    msg = str(err.value)
    assert "unknown args 'api_key' (did you mean 'api_keys'?), 'zzzzzz'; it takes" in msg
    assert "did you mean" not in msg.split("'zzzzzz'")[1]
    assert "api_keys" in msg and "max_wait_ms" in msg  # the names it does take
    assert built == {}


def test_known_args_reach_build_app(built: dict[str, Any], tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("secret-key-1 tenant-a\n")
    store = str(tmp_path / "store")
    args = {
        "store": store,
        "shards": "3",  # `serve run ... shards=3` passes strings
        "embedder": "hashing",
        "device": "cpu",
        "api_keys": str(keys),
        "sync_interval_s": 0.5,
        "shard_cpus": 1,
        "shard_gpus": "0.5",
        "max_batch": 64,
        "max_wait_ms": "1.5",
    }
    assert ray_serve.app_builder(args) == "APP"
    assert built["config"].store == store
    assert built["config"].embedder == "hashing" and built["config"].device == "cpu"
    assert built["shards"] == 3
    assert built["api_keys"] == str(keys)
    assert built["sync_interval_s"] == 0.5
    assert built["shard_cpus"] == 1.0 and built["shard_gpus"] == 0.5
    assert built["settings"].max_batch == 64 and built["settings"].max_wait_ms == 1.5


def test_config_file_and_empty_values(built: dict[str, Any], tmp_path: Path) -> None:
    """A TOML ``config`` is read (``store`` overrides it); empty or null values of the known
    args count as not given, not as unknown names."""
    toml = tmp_path / "engine.toml"
    toml.write_text(f'store = "{tmp_path / "from-toml"}"\nembedder = "hashing"\n')
    ray_serve.app_builder({"config": str(toml), "shards": 2, "device": None})
    assert built["config"].store == str(tmp_path / "from-toml")
    assert built["config"].embedder == "hashing"
    built.clear()
    ray_serve.app_builder(
        {"config": "", "store": str(tmp_path / "s"), "embedder": "hashing", "api_keys": None}
    )
    assert built["api_keys"] is None and built["config"].store == str(tmp_path / "s")


def test_shards_default_follows_serve_ray(built: dict[str, Any], tmp_path: Path) -> None:
    """Without ``shards``: a new store gets 2, a sharded store its own count (``serve --ray``'s
    rule, ``memoryos_gpu.cli.stores.ray_shards``)."""
    ray_serve.app_builder({"store": str(tmp_path / "new"), "embedder": "hashing"})
    assert built["shards"] == 2
    sharded = tmp_path / "sharded"
    prepare_layout(str(sharded), 3)
    built.clear()
    ray_serve.app_builder({"store": str(sharded), "embedder": "hashing"})
    assert built["shards"] == 3
    built.clear()
    ray_serve.app_builder({"store": str(sharded), "embedder": "hashing", "shards": None})
    assert built["shards"] == 3


@pytest.mark.parametrize("bad", [0, -1, "two", 1.5, True])
def test_bad_shards_refused(built: dict[str, Any], tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match="shards must be a whole number >= 1"):
        ray_serve.app_builder({"store": str(tmp_path / "s"), "shards": bad})
    assert built == {}


def test_deploy_yaml_args_are_accepted() -> None:
    """The args in deploy/ray-serve.yaml, and those its comments offer (``# name: value``),
    are names app_builder takes: the file an operator copies passes the check."""
    yaml = pytest.importorskip("yaml")
    path = ROOT / "deploy" / "ray-serve.yaml"
    args = yaml.safe_load(path.read_text())["applications"][0]["args"]
    ray_serve.check_app_args(args)
    block = path.read_text().split("    args:\n", 1)[1]
    offered = re.findall(r"^\s+# (\w+): ", block, flags=re.MULTILINE)
    assert offered, "no commented-out example args found"
    ray_serve.check_app_args(dict.fromkeys(offered))
