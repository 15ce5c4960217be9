"""API key sources: a configured source without keys refuses to start (never open mode), error
messages never show a key, and a key given to two tenants is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from memoryos_gpu.server.auth import (
    ENV_VAR,
    KeyFileError,
    load_api_keys,
    parse_key_env,
    parse_key_file,
)

SECRET = "sk+Live/SECRETzz9="
OTHER = "key-other-0123456789"


@pytest.fixture(autouse=True)
def _no_env_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)


def _keyfile(tmp_path: Path, text: str, name: str = "keys.txt") -> Path:
    f = tmp_path / name
    f.write_text(text)
    return f


# ----------------------------------------------------------------------------- empty sources
@pytest.mark.parametrize("text", ["", "# keys will go here\n", "\n  \n# a\n#b c\n"])
def test_key_file_without_keys_is_refused(tmp_path: Path, text: str) -> None:
    f = _keyfile(tmp_path, text)
    with pytest.raises(KeyFileError, match="holds no key") as err:
        load_api_keys(f)
    assert str(f) in str(err.value)
    with pytest.raises(KeyFileError, match="holds no key"):
        load_api_keys(str(f))


def test_empty_file_is_refused_even_with_env_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_VAR, f"{OTHER}:acme")
    with pytest.raises(KeyFileError, match="holds no key"):
        load_api_keys(_keyfile(tmp_path, "# nothing yet\n"))


@pytest.mark.parametrize("value", ["", "  ", ",,", " , "])
def test_env_var_set_without_keys_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV_VAR, value)
    with pytest.raises(KeyFileError, match=ENV_VAR):
        load_api_keys(None)
    assert load_api_keys(None, use_env=False) is None  # the variable is not read: open


def test_empty_mapping_is_refused() -> None:
    with pytest.raises(KeyFileError, match="no key"):
        load_api_keys({})


def test_no_source_at_all_is_open_mode(tmp_path: Path) -> None:
    assert load_api_keys(None) is None
    f = _keyfile(tmp_path, f"# acme\n{OTHER} acme\n")
    assert load_api_keys(f) == {OTHER: "acme"}


# ----------------------------------------------------------------------------- no key in errors
def test_swapped_columns_never_show_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = _keyfile(tmp_path, f"customer1 {SECRET}\n", "keys_swapped.txt")
    with pytest.raises(KeyFileError) as err:
        parse_key_file(f)
    msg = str(err.value)
    assert SECRET not in msg and "SECRET" not in msg
    assert "keys_swapped.txt:1" in msg and "swapped" in msg and "KEY TENANT" in msg
    with pytest.raises(KeyFileError) as err:
        load_api_keys(f)
    assert "SECRET" not in str(err.value)
    # the variable: "TENANT:KEY" instead of "KEY:TENANT" (the key holds no ':')
    monkeypatch.setenv(ENV_VAR, f"{OTHER}:acme,customer1:{SECRET}")
    with pytest.raises(KeyFileError) as err:
        load_api_keys(None)
    msg = str(err.value)
    assert "SECRET" not in msg and "customer1" not in msg and f"{ENV_VAR} entry 2" in msg


def test_bad_tenant_in_mapping_not_quoted() -> None:
    with pytest.raises(KeyFileError) as err:
        load_api_keys({OTHER: SECRET})
    assert "SECRET" not in str(err.value) and OTHER not in str(err.value)


# ----------------------------------------------------------------------------- a key, two tenants
def test_same_key_two_tenants_in_file_is_refused(tmp_path: Path) -> None:
    f = _keyfile(tmp_path, f"{OTHER} acme\n# x\n{SECRET} beta\n{SECRET} gamma\n")
    with pytest.raises(KeyFileError, match="two different tenants") as err:
        parse_key_file(f)
    msg = str(err.value)
    assert f"{f}:3" in msg and f"{f}:4" in msg and "SECRET" not in msg
    with pytest.raises(KeyFileError, match="two different tenants"):
        load_api_keys(f)


def test_same_key_file_and_env_two_tenants_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = _keyfile(tmp_path, f"{SECRET} acme\n")
    monkeypatch.setenv(ENV_VAR, f"{OTHER}:beta,{SECRET}:gamma")
    with pytest.raises(KeyFileError, match="two different tenants") as err:
        load_api_keys(f)
    msg = str(err.value)
    assert f"{f}:1" in msg and f"{ENV_VAR} entry 2" in msg and "SECRET" not in msg
    monkeypatch.setenv(ENV_VAR, f"{SECRET}:acme,{SECRET}:beta")
    with pytest.raises(KeyFileError, match="two different tenants"):
        parse_key_env(os.environ[ENV_VAR])
    with pytest.raises(KeyFileError, match="two different tenants"):
        load_api_keys({SECRET: "acme"})


def test_same_key_same_tenant_twice_is_accepted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = _keyfile(tmp_path, f"{SECRET} acme\n{SECRET} acme\n{OTHER} beta\n")
    assert parse_key_file(f) == {SECRET: "acme", OTHER: "beta"}
    monkeypatch.setenv(ENV_VAR, f"{SECRET}:acme")
    assert load_api_keys(f) == {SECRET: "acme", OTHER: "beta"}


# ----------------------------------------------------------------------------- app and CLI
def test_create_app_and_run_refuse_an_empty_key_file(tmp_path: Path) -> None:
    from memoryos_gpu.config import EngineConfig
    from memoryos_gpu.server.app import create_app, run

    f = _keyfile(tmp_path, "# keys will go here\n")
    cfg = EngineConfig(embedder="hashing", store=":memory:", auto_process=False)
    with pytest.raises(KeyFileError, match="holds no key"):
        create_app(cfg, api_keys=f)
    with pytest.raises(KeyFileError, match="holds no key"):
        run(store=str(tmp_path / "s"), api_keys_file=f)


def test_serve_refuses_an_empty_key_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn
    from click.testing import CliRunner

    from memoryos_gpu import cli as cli_mod

    served: list[object] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append(app))
    f = _keyfile(tmp_path, "# keys will go here\n", "keys_empty.txt")
    store = tmp_path / "store"
    from served import free_port

    args = ["serve", "--store", str(store), "--embedder", "hashing", "--workers", "0"]
    args += ["--port", str(free_port())]  # serve checks that it can listen there first
    res = CliRunner().invoke(cli_mod.cli, [*args, "--api-keys", str(f)])
    assert served == []  # never served open
    assert res.exit_code == 2, res.output
    assert "keys_empty.txt" in res.output and "holds no key" in res.output
    # a key file with a swapped line: refused, the key not shown
    f.write_text(f"customer1 {SECRET}\n")
    res = CliRunner().invoke(cli_mod.cli, [*args, "--api-keys", str(f)])
    assert served == [] and res.exit_code == 2, res.output
    assert "SECRET" not in res.output and "keys_empty.txt:1" in res.output
