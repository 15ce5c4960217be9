#!/usr/bin/env bash
# Set up the environment (scripts/setup.sh), lint, and run the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k kernels`.
set -euo pipefail
cd "$(dirname "$0")/.."
MEMORYOS_GPU_LLAMA_SERVER=${MEMORYOS_GPU_LLAMA_SERVER:-1} bash scripts/setup.sh
. .venv/bin/activate
ruff check memoryos_gpu tests benchmarks
python -m pytest "$@"
