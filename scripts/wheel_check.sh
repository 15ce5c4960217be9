#!/usr/bin/env bash
# Install the built wheel (dist/*manylinux*.whl) with its `embed` extra into a fresh venv where
# no compiler is available, then run the quick start's ingest and retrieve from that venv:
# what a user who installs the wheel gets. torch is pinned first (this machine's CPU build).
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=$(ls -t dist/memoryos_gpu-*manylinux*.whl | head -1)
venv=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$venv")"' EXIT
"${PYTHON:-python3}" -m venv "$venv"
export CC=/bin/false CXX=/bin/false  # a wheel install must not compile anything
"$venv/bin/python" -m pip install -q "torch==2.13.0"
"$venv/bin/python" -m pip install -q --only-binary memoryos-gpu "$wheel[embed]"
store=$(dirname "$venv")/store
cd "$(dirname "$venv")"  # not the source tree: the installed package must be what runs
"$venv/bin/python" -c "import memoryos_gpu, sys; assert 'site-packages' in memoryos_gpu.__file__, memoryos_gpu.__file__"
sample=$("$venv/bin/python" -c 'from memoryos_gpu.formats import sample_chats_path; print(sample_chats_path())')
"$venv/bin/memoryos-gpu" ingest "$sample" --store "$store" --device cpu
out=$("$venv/bin/memoryos-gpu" retrieve --store "$store" --device cpu --user maya_chen "When is my marathon?")
echo "$out"
grep -qi "marathon" <<<"$out"
echo "wheel check: $(basename "$wheel") installed and ran the quick start without a compiler"
