#!/usr/bin/env bash
# What a first GPU run must show, in one go and in under 10 minutes (a lent H200: no network,
# its own torch / pybind11 / cmake / CUDA toolkit). Everything lands under $OUT (default
# ./gpu-out): summary.txt (one line per step: exit status, seconds), each step's full output,
# the JSON results. In order of importance, each step time-boxed against one overall deadline:
#
#   1. build            pip install --no-build-isolation --no-deps . with MEMOSGPU_CUDA=ON
#   2. cuda-tests       the kernel tests (tests/test_kernels.py, tests/test_kernel_grid.py,
#                       tests/test_retrieval_kernel.py: the fused retrieval pass) with CUDA
#                       skips turned into failures (MEMORYOS_GPU_REQUIRE_CUDA=1); then the
#                       engine test files on a CUDA arena (MEMORYOS_TEST_DEVICE=cuda)
#   3. kernels          benchmarks/kernel_speed.py --routine kernel-only: kernel-only GB/s (CUDA
#                       events) vs the measured device copy bandwidth, fp16 and fp32 storage,
#                       B = 1,024, S = 200, d = 384 (target: >= 50 % of copy)
#   4. sanitizer-memcheck  the CUDA tests on a reduced grid (MEMORYOS_GPU_KERNEL_GRID=small;
#                       the host-side thread race test left out) under compute-sanitizer, only
#                       our kernels instrumented (target: 0 errors); racecheck and synccheck
#                       in step 7
#   5. serve-workers    benchmarks/serve_load.py at 100 saturating users over serve --workers
#                       0 2 4 8 15 (target: 15 workers >= 5x the single process); then
#      serve-engines    the same over --workers 0 6 10 with --engines 4 (the users sharded over
#                       four engine processes: one caps near 2,800 requests/s there)
#   6. throughput-10k   benchmarks/throughput.py (hashing embedder; the engine picks the CUDA
#      retrieval-path   arena when a device is usable) at 10,000 users; retrieval_path.py at
#                       1,000 users: memory-system time per query beside the kernels'
#   7. sanitizer-racecheck, sanitizer-synccheck, throughput-100k, as the deadline allows
#
# Usage: OUT=/path/to/out bash benchmarks/gpu_check.sh   (DEADLINE_S=570 by default)
#        WHEELS=DIR ...  installs the dependencies the image lacks from DIR, no network
#                        (made elsewhere by scripts/offline_wheels.sh DIR 3.12)
#        ARCHIVE=F.tgz   also packs $OUT into one file after every step
#        STEPS="build cuda-tests engine-cuda" ... runs only the steps named (a rerun after a fix)
set -uo pipefail
WHEELS=${WHEELS:+$(cd "$WHEELS" && pwd)}
ARCHIVE=${ARCHIVE:+$(cd "$(dirname "$ARCHIVE")" && pwd)/$(basename "$ARCHIVE")}  # outside $OUT
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
START=$(date +%s)
DEADLINE_S=${DEADLINE_S:-570}
: > "$OUT/summary.txt"

left() { echo $(( DEADLINE_S - ($(date +%s) - START) )); }

# step NAME LIMIT_S CMD...: runs CMD with output in $OUT/NAME.txt, for at most LIMIT_S seconds and
# never past the deadline; records the exit status (124 = time limit) in summary.txt.
step() {
  local name=$1 limit=$2
  shift 2
  if [[ -n "${STEPS:-}" && " $STEPS " != *" $name "* ]]; then
    echo "$name: not selected" >> "$OUT/summary.txt"
    return 0
  fi
  local budget
  budget=$(left)
  if (( budget < 15 )); then
    echo "$name: skipped (deadline)" | tee -a "$OUT/summary.txt"
    return 0
  fi
  (( limit > budget )) && limit=$budget
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  rc=$?
  echo "$name: exit $rc in $(( $(date +%s) - t0 )) s (limit $limit s)" | tee -a "$OUT/summary.txt"
  tail -4 "$OUT/$name.txt"
  archive
  return 0
}

# ARCHIVE=FILE.tgz: everything under $OUT packed into one file after every step (a run cut off
# by its caller's time limit still leaves what it had done; some runners bring back few files)
archive() {
  [[ -n "${ARCHIVE:-}" ]] || return 0
  tar czf "$ARCHIVE.part" -C "$(dirname "$OUT")" "$(basename "$OUT")" && mv -f "$ARCHIVE.part" "$ARCHIVE"
}

# images with python3 alone: a script, not a link (a venv's interpreter finds its pyvenv.cfg
# through the path it runs as)
if [[ -z "$(command -v python || true)" ]]; then
  mkdir -p "$OUT/bin"
  printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > "$OUT/bin/python"
  chmod +x "$OUT/bin/python"
  export PATH=$OUT/bin:$PATH
fi

{
  date -u
  git -C "$ROOT" log -1 --format='commit %H %cd' 2>/dev/null || true
  nvidia-smi || true
  python -V
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version 2>/dev/null | tail -1 || true
  nproc
} > "$OUT/env.txt" 2>&1

SANITIZER=$(command -v compute-sanitizer || true)
for d in /usr/local/cuda/bin /usr/local/cuda/compute-sanitizer /opt/nvidia/cuda/bin; do
  [[ -z "$SANITIZER" && -x "$d/compute-sanitizer" ]] && SANITIZER=$d/compute-sanitizer
done
[[ -z "$(command -v nvcc || true)" && -x /usr/local/cuda/bin/nvcc ]] && export PATH=$PATH:/usr/local/cuda/bin
echo "compute-sanitizer: ${SANITIZER:-not found}" >> "$OUT/env.txt"

# 1. build (the installed package is what every later step imports, from outside the tree); with
# WHEELS=DIR (scripts/offline_wheels.sh) the dependencies the image lacks come from DIR
if [[ -n "${WHEELS:-}" ]]; then
  INSTALL=(--no-index --find-links "$WHEELS" "$ROOT[server]")
else
  INSTALL=(--no-deps "$ROOT")
fi
step build 240 env MEMOSGPU_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 \
  python -m pip install --no-build-isolation -v "${INSTALL[@]}"
if ! grep -q "build: exit 0" "$OUT/summary.txt"; then
  echo "build failed: see $OUT/build.txt"
  exit 1
fi
cd /tmp || exit 1
python -c "from memoryos_gpu.ops import build_info; print(build_info())" | tee "$OUT/build_info.txt"
TESTS=("$ROOT/tests/test_kernels.py" "$ROOT/tests/test_kernel_grid.py"
       "$ROOT/tests/test_retrieval_kernel.py")
PYTEST=(python -m pytest -q -p no:cacheprovider --maxfail=10 -rs)

# 2. the CUDA tests, full grid (CPU cases run too: they are the same oracle); a first run on a
# device shows every failure, not the first one only
step cuda-tests 150 env MEMORYOS_GPU_REQUIRE_CUDA=1 "${PYTEST[@]}" "${TESTS[@]}"

# every test file whose engines take the arena's device from $MEMORYOS_TEST_DEVICE (the slow
# ones run the bundled MiniLM on a CPU engine: not device tests)
ENGINE_TESTS=()
for f in test_engine test_retrieval_path test_fusion test_mem0 test_postings test_retrieval_json \
         test_vocabulary test_derived_concurrency; do
  ENGINE_TESTS+=("$ROOT/tests/$f.py")
done
step engine-cuda 120 env MEMORYOS_TEST_DEVICE=cuda "${PYTEST[@]}" -m "not slow" "${ENGINE_TESTS[@]}"

# 3. kernel-only bandwidth, fp16 and fp32 storage
step kernels 90 python "$ROOT/benchmarks/kernel_speed.py" --routine kernel-only --device cuda \
  --users 10000 --batch 1024 --slots 200 --dim 384 --pages-per-segment 2 --repeat 20 \
  --dtypes float16 float32 --json "$OUT/kernels_gpu.json"

# 4. compute-sanitizer on the reduced grid, CUDA cases only, our kernels only
sanitize() {
  local tool=$1 limit=$2
  if [[ -z "$SANITIZER" ]]; then
    echo "sanitizer-$tool: skipped (compute-sanitizer not found)" | tee -a "$OUT/summary.txt"
    return 0
  fi
  step "sanitizer-$tool" "$limit" env MEMORYOS_GPU_REQUIRE_CUDA=1 MEMORYOS_GPU_KERNEL_GRID=small \
    "$SANITIZER" --tool "$tool" --error-exitcode 86 --kernel-name kns=memoryos \
    --print-limit 20 "${PYTEST[@]}" -k "cuda and not concurrent" "${TESTS[@]}"
  [[ -f "$OUT/sanitizer-$tool.txt" ]] || return 0
  grep -h "ERROR SUMMARY\|RACECHECK SUMMARY\|error(s)" "$OUT/sanitizer-$tool.txt" | tail -2 \
    | sed "s/^/  $tool: /" | tee -a "$OUT/summary.txt"
}
sanitize memcheck 90

# 5. serving over HTTP worker processes on every core (issue: serve --workers): requests/s
# over layouts against the single process, in one run; the users dealt over several client
# processes (one saturates a core near 10,000 requests/s)
step serve-workers 130 python "$ROOT/benchmarks/serve_load.py" --users 100 \
  --workers 0 2 4 8 15 --rounds 1 --no-unbatched --requests 1000000 --time-limit 12 \
  --paced-think-ms 0 --client-procs 4 --out "$OUT/serve_workers_gpu.json" \
  --plot "$OUT/serve_workers_gpu.png"
step serve-engines 100 python "$ROOT/benchmarks/serve_load.py" --users 100 \
  --workers 0 6 10 --engines 4 --rounds 1 --no-unbatched --requests 1000000 --time-limit 12 \
  --paced-think-ms 0 --client-procs 4 --out "$OUT/serve_engines_gpu.json"

# 6. end to end with the CUDA arena (the engine's device is "auto": CUDA when usable); the
# LoCoMo dev split it builds users from is looked up where checkouts keep shared/
LOCOMO=${MEMORYOS_GPU_LOCOMO:-}
for f in "$ROOT/shared/data/locomo/locomo_dev.json" "$ROOT/../shared/data/locomo/locomo_dev.json" \
         /work/shared/data/locomo/locomo_dev.json; do
  [[ -z "$LOCOMO" && -f "$f" ]] && LOCOMO=$f
done
if [[ -n "$LOCOMO" ]]; then
  step throughput-10k 120 python "$ROOT/benchmarks/throughput.py" --users 10000 \
    --pages-per-user 10 --embedder hashing --data "$LOCOMO" --json "$OUT/throughput_10k.json"
  step retrieval-path 100 python "$ROOT/benchmarks/retrieval_path.py" --users 1000 \
    --queries 4096 --data "$LOCOMO" --json "$OUT/retrieval_path_gpu.json"
else
  echo "throughput: skipped (no locomo_dev.json; set MEMORYOS_GPU_LOCOMO)" | tee -a "$OUT/summary.txt"
fi

# 7. the other sanitizers, and the largest scale, as time allows
sanitize racecheck 80
sanitize synccheck 60
if [[ -n "$LOCOMO" ]]; then
  step throughput-100k 150 python "$ROOT/benchmarks/throughput.py" --users 100000 \
    --pages-per-user 2 --embedder hashing --data "$LOCOMO" --json "$OUT/throughput_100k.json"
fi

echo "total: $(( $(date +%s) - START )) s" | tee -a "$OUT/summary.txt"
archive
