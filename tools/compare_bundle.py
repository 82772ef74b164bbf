"""Bundle `tokentop compare` reports into one kept report (docs/bench/compare-seeds-CLASS.json).

`tokentop compare` writes one A/B report per run and records neither the machine nor its own
command line; the kept report holds several runs per experiment, each with the command that
wrote it, plus this machine's CPU (engine.bench.machine(): the reports' class comes from it).

    python tools/compare_bundle.py OUT.json --run EXPERIMENT LABEL REPORT.json "COMMAND" [--run ...]

e.g. --run single_flight "N = 2" /tmp/sf2.json "tokentop compare sample_prompts/single_flight_2.jsonl ..."
Run it on the machine that ran the compares.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def bundle(runs: list[tuple[str, str, str, str]]) -> dict:
    from engine.bench import machine
    experiments: dict[str, list[dict]] = {}
    for experiment, label, path, command in runs:
        report = json.loads(Path(path).read_text())
        experiments.setdefault(experiment, []).append({"label": label, "command": command, "report": report})
    return {"scenario": "compare-seeds",
            "command": "tokentop compare (one run per entry, its command kept with it)",
            "machine": machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "experiments": experiments}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--run", nargs=4, action="append", required=True,
                   metavar=("EXPERIMENT", "LABEL", "REPORT", "COMMAND"))
    args = p.parse_args(argv)
    Path(args.out).write_text(json.dumps(bundle([tuple(r) for r in args.run]), indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
