#!/usr/bin/env bash
# Wheels for installing memoryos-gpu on a machine without network: a GPU box whose image has
# Python, torch, numpy and a compiler, but not this package's own dependencies (pydantic,
# jsonschema, json-repair, ijson, ...) nor the server's (fastapi, uvicorn, pyzmq, ...). Without
# them `pip install --no-deps .` builds, and the package then fails at its first import.
#
# Here (with network):
#   bash scripts/offline_wheels.sh DIR [PYTHON_VERSION]        # e.g. wheels 3.12
# There (copy DIR beside the checkout):
#   pip install --no-index --find-links DIR scikit-build-core pybind11    # if the image lacks them
#   pip install --no-index --find-links DIR --no-build-isolation '.[server]'
#
# DIR gets every wheel the core, the server extra and the build need, resolved for x86-64 Linux
# (manylinux) and that CPython version, at the versions installed in this checkout's .venv where
# it has them (what CI tested). On the target pip keeps whatever the image already has that
# satisfies a requirement and takes only the rest from DIR.
set -euo pipefail
dir=${1:?usage: scripts/offline_wheels.sh DIR [PYTHON_VERSION]}
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
[[ -x "$py" ]] || py=python3
pyver=${2:-$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# the requirements: core, the server extra, the build backend
"$py" - "$root/pyproject.toml" > "$tmp/requirements.txt" <<'PY'
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    doc = tomllib.load(f)
project = doc["project"]
reqs = project["dependencies"] + project["optional-dependencies"]["server"]
print("\n".join(reqs + doc["build-system"]["requires"]))
PY
# the versions installed here, as constraints (this package itself and editable lines left out)
"$py" -m pip freeze 2>/dev/null | grep -E '^[A-Za-z0-9_.-]+==' | grep -v '^memoryos-gpu==' \
  > "$tmp/constraints.txt" || true

platforms=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
mkdir -p "$dir"
"$py" -m pip download --only-binary=:all: --implementation cp --python-version "$pyver" \
  "${platforms[@]}" -d "$dir" -r "$tmp/requirements.txt" -c "$tmp/constraints.txt"
echo "$(find "$dir" -name '*.whl' | wc -l) wheels, $(du -sh "$dir" | cut -f1), in $dir (CPython $pyver)"
