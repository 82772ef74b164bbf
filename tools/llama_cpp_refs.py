"""Record llama.cpp's greedy ids and top-5 logits on the tiny model of each architecture and quant type."""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fixtures.llama_cpp_cases import (CASES, NEW_TOKENS, REFERENCE_PATH, TOP_K,  # noqa: E402
                                            prompts, sha256, write_case)

GGML_TYPE_F32 = 0
USAGE = """\
Dev-time tool, not part of the product: it needs llama-cpp-python (the llama-refs extra,
built from source: CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install llama-cpp-python==0.3.36).
Each case of tests/fixtures/llama_cpp_cases.py is rebuilt from its seed, loaded by llama.cpp
with fp32 K/V (tokentop's KV store is fp32) and run greedily from each prompt (token ids).
Per step it records the greedy id, the top-5 ids and logits and the gap between the two best
logits, into tests/data/llama_cpp_reference.json (tests/test_llama_cpp_refs.py reads it).

    PYTHONPATH=. python tools/llama_cpp_refs.py [--case NAME ...]
"""


def greedy(llm, prompt: list[int]) -> dict:
    """NEW_TOKENS greedy steps after `prompt`, with the top-k of every step's logits."""
    llm.reset()
    llm.eval(prompt)
    ids, top_ids, top_logits, gaps = [], [], [], []
    for _ in range(NEW_TOKENS):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        top = np.argsort(-logits, kind="stable")[:TOP_K]
        ids.append(int(top[0]))
        top_ids.append(top.tolist())
        top_logits.append([round(float(logits[t]), 5) for t in top])
        gaps.append(round(float(logits[top[0]] - logits[top[1]]), 5))
        llm.eval([ids[-1]])
    return {"prompt_ids": prompt, "greedy_ids": ids, "top_ids": top_ids, "top_logits": top_logits,
            "top2_gap": gaps}


def reference_for(name: str, folder: Path, threads: int) -> dict:
    from llama_cpp import Llama

    path = write_case(name, folder)
    # logits_all: llama-cpp-python fills `scores` only then
    llm = Llama(model_path=str(path), n_ctx=128, n_batch=128, n_threads=threads, type_k=GGML_TYPE_F32,
                type_v=GGML_TYPE_F32, logits_all=True, verbose=False)
    runs = [greedy(llm, p) for p in prompts()]
    del llm
    print(f"{name}: min top-2 gap {min(min(r['top2_gap']) for r in runs):.3f}", flush=True)
    return {"sha256": sha256(path), "bytes": path.stat().st_size, "prompts": runs}


def compact_json(data: dict) -> str:
    """Indented JSON with each list of numbers on one line (a step's top 5, a prompt's ids)."""
    text = json.dumps(data, indent=1)
    return re.sub(r"\[\s*([-\d.e,\s]+?)\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m[1].split(",")) + "]", text) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, epilog=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="only these cases (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REFERENCE_PATH))
    args = ap.parse_args()
    import llama_cpp

    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {"cases": {}}
    data["generator"] = {"tool": "tools/llama_cpp_refs.py", "llama_cpp_python": llama_cpp.__version__,
                         "kv_type": "f32", "threads": args.threads, "new_tokens": NEW_TOKENS, "top_k": TOP_K}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.case or CASES:
            data["cases"][name] = reference_for(name, Path(tmp), args.threads)
    data["cases"] = {n: data["cases"][n] for n in CASES if n in data["cases"]}
    out.write_text(compact_json(data))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
