#!/usr/bin/env bash
# The CUDA workers' check on a GPU machine: fidelity, kernel choice, benches, NVTX (tools/gpu_check.py).
#   tools/gpu_check.sh [OUTDIR] [gpu_check.py flags...]     e.g. tools/gpu_check.sh "$OUT" --model /tmp/models/qwen0.5.gguf
#   tools/gpu_check.sh DIR --dry-run                         every step on the CPU with a tiny model
# Writes OUTDIR/gpu_check.json and gpu_check.txt; prints the table last. PYTHON picks the interpreter.
# How to carry a model to a lent GPU machine and run it there: docs/gpu_check.md.
set -u
cd "$(dirname "$0")/.."
case "${1:-}" in
    -h|--help) sed -n '2,6p' tools/gpu_check.sh | cut -c3-; exit 0 ;;
esac
outdir=${1:-${OUT:-gpu_check_out}}
[ $# -gt 0 ] && shift
export PYTHONUNBUFFERED=1
mkdir -p "$outdir"
"${PYTHON:-python3}" tools/gpu_check.py --out "$outdir" "$@" 2>&1 | tee "$outdir/gpu_check.log"
