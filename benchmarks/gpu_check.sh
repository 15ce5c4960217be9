#!/usr/bin/env bash
# One prepared GPU check (for the lent H200 machine: no network, its own torch/pybind11/cmake):
# build the extension with CUDA, run the kernel tests with CUDA skips turned into failures, run the
# kernel benchmark on the device, and leave everything under $OUT (default ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
{
  date -u; nvidia-smi || true; python -V; python -c "import torch; print('torch', torch.__version__)"
} > "$OUT/env.txt" 2>&1
MEMOSGPU_CUDA=ON python -m pip install --no-build-isolation --no-deps -v . > "$OUT/build.log" 2>&1 \
  || { echo "build failed"; tail -50 "$OUT/build.log"; exit 1; }
python -c "from memoryos_gpu.ops import build_info; print(build_info())" | tee "$OUT/build_info.txt"
cd /tmp  # import the installed package, not the source tree
MEMORYOS_GPU_REQUIRE_CUDA=1 timeout 300 python -m pytest -q -x -p no:cacheprovider \
  "$OLDPWD/tests/test_kernels.py" > "$OUT/test_kernels.txt" 2>&1
echo "kernel tests exit $?" | tee -a "$OUT/test_kernels.txt"
tail -5 "$OUT/test_kernels.txt"
timeout 400 python "$OLDPWD/benchmarks/kernels.py" --device cuda --users 1000 10000 \
  --pages-per-segment 20 20 --json "$OUT/kernels_gpu.json" > "$OUT/kernels_gpu.txt" 2>&1
echo "kernel benchmark exit $?" | tee -a "$OUT/kernels_gpu.txt"
tail -8 "$OUT/kernels_gpu.txt"
