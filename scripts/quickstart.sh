#!/usr/bin/env bash
# The main job on the embedded defaults: set up, bulk-ingest the bundled sample chat log
# (3 users x 25 exchanges) into a SQLite store on the CPU path with the bundled MiniLM
# embeddings, then retrieve one user's memory for a question.
#   STORE=DIR bash scripts/quickstart.sh     (default ./memoryos-store)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
store=${STORE:-./memoryos-store}
sample=$(python -c 'from memoryos_gpu.formats import sample_chats_path; print(sample_chats_path())')
memoryos-gpu ingest "$sample" --store "$store" --device cpu
memoryos-gpu retrieve --store "$store" --device cpu --user maya_chen "When is my marathon?"
