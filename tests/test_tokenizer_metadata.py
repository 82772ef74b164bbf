"""Tokenizer metadata from a file: each kind of bad tokenizer.* value is a one-line ModelError
naming the file, the key and what is wrong, raised when the tokenizer is built (a worker's
start), never an IndexError or a tokenizers TypeError then or at the first request.

Each case is a tiny GGUF model (tests/fixtures/tiny_gguf.py) with one tokenizer key rewritten;
`omit` + `metadata` together give a key another value type.
"""
from __future__ import annotations

import pytest

from engine.errors import ModelError
from engine.models.tokenizer import Tokenizer
from engine.models.tokenizer_metadata import MAX_TOKEN_CHARS
from tests.fixtures.tiny_gguf import MERGES, tiny_vocab

TOKENS, TYPES = tiny_vocab()
N = len(TOKENS)
SENTENCEPIECE = {"tokenizer.ggml.model": "llama"}     # with merges omitted: rebuilt from the vocabulary


def _replaced(values: list, i: int, value) -> list:
    return values[:i] + [value] + values[i + 1:]


# (case, keys omitted, metadata written, the key named, what the message says)
CASES = [
    # the vocabulary
    ("no tokens", ["tokenizer.ggml.tokens"], {}, "tokenizer.ggml.tokens", "has no tokenizer.ggml.tokens"),
    ("token not UTF-8", [], {"tokenizer.ggml.tokens": _replaced(TOKENS, 10, b"\xff\xfe")},
     "tokenizer.ggml.tokens", "entry 10 of metadata tokenizer.ggml.tokens is not valid UTF-8"),
    ("control token not UTF-8", [], {"tokenizer.ggml.tokens": _replaced(TOKENS, N - 1, b"<|im_end\xff")},
     "tokenizer.ggml.tokens", f"entry {N - 1} of metadata tokenizer.ggml.tokens is not valid UTF-8"),
    ("token too long", [], {"tokenizer.ggml.tokens": _replaced(TOKENS, 10, "x" * (MAX_TOKEN_CHARS + 1))},
     "tokenizer.ggml.tokens", f"{MAX_TOKEN_CHARS + 1:,} characters long"),
    # token types
    ("token_type too short", [], {"tokenizer.ggml.token_type": TYPES[:-1]},
     "tokenizer.ggml.token_type", f"has {N - 1} entries but tokenizer.ggml.tokens has {N}"),
    ("token_type too long", [], {"tokenizer.ggml.token_type": TYPES + [1]},
     "tokenizer.ggml.token_type", f"has {N + 1} entries but tokenizer.ggml.tokens has {N}"),
    ("token_type unknown", [], {"tokenizer.ggml.token_type": _replaced(TYPES, 5, 9)},
     "tokenizer.ggml.token_type", "entry 5 of metadata tokenizer.ggml.token_type is 9, not a token type"),
    ("token_type floats", ["tokenizer.ggml.token_type"], {"tokenizer.ggml.token_type": [1.0] * N},
     "tokenizer.ggml.token_type", "entry 0 of metadata tokenizer.ggml.token_type is 1.0, not a token type"),
    ("token_type a number", ["tokenizer.ggml.token_type"], {"tokenizer.ggml.token_type": 1},
     "tokenizer.ggml.token_type", "is 1, but it must be a list of one entry per token"),
    # scores
    ("scores too short", [], {**SENTENCEPIECE, "tokenizer.ggml.scores": [0.0] * (N - 1)},
     "tokenizer.ggml.scores", f"has {N - 1} entries but tokenizer.ggml.tokens has {N}"),
    ("score NaN", [], {**SENTENCEPIECE, "tokenizer.ggml.scores": _replaced([0.0] * N, 3, float("nan"))},
     "tokenizer.ggml.scores", "entry 3 of metadata tokenizer.ggml.scores is nan, not a number"),
    ("scores strings", [], {**SENTENCEPIECE, "tokenizer.ggml.scores": ["0"] * N},
     "tokenizer.ggml.scores", "entry 0 of metadata tokenizer.ggml.scores is '0', not a number"),
    # merges
    ("merge without a space", [], {"tokenizer.ggml.merges": _replaced(MERGES, 1, "he")},
     "tokenizer.ggml.merges", "entry 1 of metadata tokenizer.ggml.merges is 'he', not two tokens separated"),
    ("merge of an unknown token", [], {"tokenizer.ggml.merges": _replaced(MERGES, 2, "Ġ ☃")},
     "tokenizer.ggml.merges", "entry 2 of metadata tokenizer.ggml.merges, 'Ġ ☃', names '☃', which is not"),
    ("merge into an unknown token", [], {"tokenizer.ggml.merges": _replaced(MERGES, 0, "h i")},
     "tokenizer.ggml.merges", "entry 0 of metadata tokenizer.ggml.merges, 'h i', merges into 'hi', which is not"),
    ("merge of three tokens", [], {"tokenizer.ggml.merges": _replaced(MERGES, 0, "h e l")},
     "tokenizer.ggml.merges", "names 'e l', which is not"),
    ("SentencePiece merge of an unknown token", [], {**SENTENCEPIECE, "tokenizer.ggml.merges": ["Ġ ☃"]},
     "tokenizer.ggml.merges", "names '☃', which is not in the vocabulary"),
    ("merges numbers", ["tokenizer.ggml.merges"], {"tokenizer.ggml.merges": [1, 2]},
     "tokenizer.ggml.merges", "entry 0 of metadata tokenizer.ggml.merges is 1, not a string"),
    ("merges a string", ["tokenizer.ggml.merges"], {"tokenizer.ggml.merges": "h e"},
     "tokenizer.ggml.merges", "is 'h e', but it must be a list of strings"),
    # token ids
    ("bos past the vocabulary", [], {"tokenizer.ggml.bos_token_id": N},
     "tokenizer.ggml.bos_token_id", f"is {N}, but it must be a token id of the vocabulary"),
    ("eos negative", ["tokenizer.ggml.eos_token_id"], {"tokenizer.ggml.eos_token_id": -1},
     "tokenizer.ggml.eos_token_id", f"is -1, but it must be a token id of the vocabulary (tokenizer.ggml."
                                    f"tokens has {N} tokens, ids 0 to {N - 1})"),
    ("eot past the vocabulary", [], {"tokenizer.ggml.eot_token_id": 2**31 - 1},
     "tokenizer.ggml.eot_token_id", "is 2147483647, but it must be a token id"),
    ("pad a string", ["tokenizer.ggml.padding_token_id"], {"tokenizer.ggml.padding_token_id": "0"},
     "tokenizer.ggml.padding_token_id", "is '0', but it must be a token id"),
    ("unknown past the vocabulary", [], {**SENTENCEPIECE, "tokenizer.ggml.unknown_token_id": N + 5},
     "tokenizer.ggml.unknown_token_id", f"is {N + 5}, but it must be a token id"),
    # flags
    ("add_bos a number", ["tokenizer.ggml.add_bos_token"], {"tokenizer.ggml.add_bos_token": 1},
     "tokenizer.ggml.add_bos_token", "is 1, but it must be true or false"),
    ("add_space_prefix a string", [], {**SENTENCEPIECE, "tokenizer.ggml.add_space_prefix": "false"},
     "tokenizer.ggml.add_space_prefix", "is 'false', but it must be true or false"),
    # the kind of tokenizer, its pre-tokenizer, its chat template
    ("unknown tokenizer model", [], {"tokenizer.ggml.model": "bert"},
     "tokenizer.ggml.model", "tokenizer type 'bert' (metadata tokenizer.ggml.model) is not supported"),
    ("unknown tokenizer model, long", [], {"tokenizer.ggml.model": "x" * 100_000},
     "tokenizer.ggml.model", "tokenizer type 'xxxx"),
    ("no tokenizer model", ["tokenizer.ggml.model"], {},
     "tokenizer.ggml.model", "has no tokenizer.ggml.model"),
    ("tokenizer model a number", ["tokenizer.ggml.model"], {"tokenizer.ggml.model": 3},
     "tokenizer.ggml.model", "is 3, but it must be a string"),
    ("unknown pre-tokenizer", [], {"tokenizer.ggml.pre": "starcoder"},
     "tokenizer.ggml.pre", "pre-tokenizer 'starcoder' (metadata tokenizer.ggml.pre) is not supported"),
    ("pre-tokenizer a list", ["tokenizer.ggml.pre"], {"tokenizer.ggml.pre": ["qwen2"]},
     "tokenizer.ggml.pre", "is ['qwen2'], but it must be a string"),
    ("chat template a number", ["tokenizer.chat_template"], {"tokenizer.chat_template": 7},
     "tokenizer.chat_template", "is 7, but it must be a string"),
    ("chat template not UTF-8", [], {"tokenizer.chat_template": b"{{ messages }}\xff"},
     "tokenizer.chat_template", "tokenizer.chat_template is not valid UTF-8"),
]


@pytest.mark.parametrize("omit, metadata, key, what", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_tokenizer_metadata_is_one_line_naming_file_and_key(tiny_model_path, omit, metadata, key, what):
    path = tiny_model_path("qwen2", omit=omit, metadata=metadata)
    with pytest.raises(ModelError) as refused:
        Tokenizer.from_gguf(path)
    message = str(refused.value)
    assert "\n" not in message and len(message) < 600 and message.startswith(f"{path}: "), message
    assert key in message and what in message, message


def test_the_checks_refuse_nothing_the_tiny_vocabularies_need(tiny_model_path):
    """Byte-level BPE files and a SentencePiece one (merges rebuilt from the vocabulary,
    scores, an unknown token, an eot id) with every key well-formed build and round-trip text
    (the tiny vocabulary has no ▁, so the SentencePiece one is given no spaces)."""
    spm = {**SENTENCEPIECE, "tokenizer.ggml.scores": [-float(i) for i in range(N)],
           "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": False,
           "tokenizer.ggml.eot_token_id": N - 1}
    for path, text in ((tiny_model_path("qwen2"), "hello there, world\n"),
                       (tiny_model_path("gemma3"), "hello there, world\n"),
                       (tiny_model_path("llama", omit=["tokenizer.ggml.merges"], metadata=spm), "the,hat")):
        tok = Tokenizer.from_gguf(path)
        assert tok.decode(tok.encode(text, add_special=False)) == text
        assert tok.decode(list(range(tok.vocab_size)))


def test_metadata_without_a_file_names_the_model():
    from tests.test_tokenizer import tiny_gpt2_metadata
    with pytest.raises(ModelError, match=r"^model tiny-gpt2: metadata tokenizer\.ggml\.bos_token_id is 9999,"):
        Tokenizer.from_metadata(tiny_gpt2_metadata(**{"tokenizer.ggml.bos_token_id": 9999}))
