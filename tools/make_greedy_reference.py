"""Record greedy reference continuations of real GGUF models with Hugging Face transformers."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch

# transformers is imported where it is used: it lives in a separate virtualenv (USAGE), and
# --help works without it.
USAGE = """\
Dev-time tool, not part of the product: it runs in a separate virtualenv that has
transformers (e.g. REFVENV), loads the *same* GGUF file through transformers' own
GGUF loader (dequantized to fp32, HF's independent model code) and writes, per prompt,
the prompt token ids, the first N greedy token ids and the gap between the two best
logits at each step (so a test can tell a real bug from a near-tie flipping).

    PATH/TO/python tools/make_greedy_reference.py \\
        --model qwen2.5-coder-0.5b=/tmp/models/qwen0.5.gguf \\
        --model gemma3-270m=/tmp/models/gemma3-270m.gguf \\
        --model qwen2.5-coder-1.5b=/tmp/models/qwen1.5.gguf
"""

NEW_TOKENS = 32
TOP_K_FIRST = 8  # top logits of the first prediction, for a numeric (not only argmax) check

# (name, text, chat): chat prompts go through the model's own chat template when it has one.
PROMPTS = [
    ("france", "The capital of France is", False),
    ("code", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    ("chat", "Write a Python function that checks whether a string is a palindrome.", True),
    ("unicode", "Übersetze: «Der Bär isst Äpfel» → English: \"The bear eats apples\". 日本語では、", False),
    ("planets", "The planets of the solar system, in order from the Sun, are", False),
    ("list", "Shopping list:\n1. eggs\n2. milk\n3.", False),
]
# Only for models with sliding-window layers: a prompt longer than Gemma 3's 512-token window.
LONG_PROMPT = ("long", "A table of squares.\n" + "".join(f"{i} squared is {i * i}.\n" for i in range(1, 62)), False)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def prompt_ids(tok, text: str, chat: bool) -> list[int]:
    if chat and tok.chat_template:
        msgs = [{"role": "user", "content": text}]
        out = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(map(int, out))
    return tok(text)["input_ids"]


@torch.inference_mode()
def greedy(model, ids: list[int]) -> dict:
    """Plain greedy loop with HF's KV cache; no generate() so eos/generation_config can't interfere."""
    out = model(torch.tensor([ids]), use_cache=True)
    past, logits = out.past_key_values, out.logits[0, -1].float()
    first_top = torch.topk(logits, TOP_K_FIRST)
    tokens, gaps = [], []
    for _ in range(NEW_TOKENS):
        top2 = torch.topk(logits, 2)
        tokens.append(int(top2.indices[0]))
        gaps.append(round(float(top2.values[0] - top2.values[1]), 5))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1].float()
    return {
        "greedy_ids": tokens,
        "top2_gap": gaps,
        "first_topk_ids": first_top.indices.tolist(),
        "first_topk_logits": [round(float(v), 5) for v in first_top.values],
    }


def reference_for(path: Path, previous: dict | None) -> dict:
    """Records for every prompt; those already in `previous` for the same file are kept."""
    digest = sha256(path)
    kept = {p["name"]: p for p in previous["prompts"]} if previous and previous["sha256"] == digest else {}
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, f = str(path.parent), path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    sliding = "sliding_attention" in (getattr(model.config, "layer_types", None) or ())
    prompts = []
    for name, text, chat in PROMPTS + ([LONG_PROMPT] if sliding else []):
        ids = prompt_ids(tok, text, chat)
        old = kept.get(name)
        if old is not None and old["text"] == text and old["prompt_ids"] == ids:
            prompts.append(old)
            continue
        t0 = time.perf_counter()
        rec = greedy(model, ids)
        print(f"  {name}: {len(ids)} prompt tokens, {time.perf_counter() - t0:.1f}s: "
              f"{tok.decode(rec['greedy_ids'])!r} min gap {min(rec['top2_gap']):.4f}", flush=True)
        prompts.append({"name": name, "text": text, "chat": chat, "prompt_ids": ids,
                        "completion": tok.decode(rec["greedy_ids"]), **rec})
    return {"file": str(path), "sha256": digest, "prompts": prompts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, epilog=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, metavar="NAME=PATH.gguf")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/data/greedy_reference.json"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import transformers
    torch.set_num_threads(args.threads)

    out_path = Path(args.out)
    data = json.loads(out_path.read_text()) if out_path.exists() else {"models": {}}
    data["generator"] = {"transformers": transformers.__version__, "torch": torch.__version__,
                         "dtype": "float32", "attn_implementation": "eager",
                         "new_tokens": NEW_TOKENS, "tool": "tools/make_greedy_reference.py"}
    for spec in args.model:
        name, _, p = spec.partition("=")
        print(f"{name}: {p}", flush=True)
        data["models"][name] = reference_for(Path(os.path.expanduser(p)), data["models"].get(name))
        out_path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
