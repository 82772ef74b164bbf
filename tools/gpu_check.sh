#!/usr/bin/env bash
# The CUDA workers' check on a GPU machine, one prepared run (tools/gpu_check.py; ~7.5 min on an H200):
#   tools/gpu_check.sh [OUTDIR] [gpu_check.py flags...]   e.g. tools/gpu_check.sh "$OUT" --model /tmp/models/qwen0.5.gguf
#   tools/gpu_check.sh --dry-run                           on the CPU, tiny model: checks the script (also without a GPU)
# OUTDIR defaults to $OUT, else gpu_check_out; it gets gpu_check.json, .txt, .log, routing-log.jsonl, tokentop-*.json.
# How to carry a model to a lent GPU machine and run it there: docs/gpu_check.md. PYTHON picks the interpreter.
set -u
cd "$(dirname "$0")/.."
case "${1:-}" in
    -h|--help) sed -n '2,6p' tools/gpu_check.sh | cut -c3-; exit 0 ;;
esac
outdir=${OUT:-gpu_check_out}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    outdir=$1
    shift
fi
export PYTHONUNBUFFERED=1
mkdir -p "$outdir"
set -o pipefail
"${PYTHON:-python3}" tools/gpu_check.py --out "$outdir" "$@" 2>&1 | tee "$outdir/gpu_check.log"
