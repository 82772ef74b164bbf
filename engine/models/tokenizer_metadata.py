"""Checks of a GGUF file's tokenizer metadata (tokenizer.*), before a tokenizer is built from it.

The keys come from a file that may be corrupt or hostile. Unchecked, a token id past the
vocabulary, a token_type list of another length, a merge naming no token or a string that is
not UTF-8 fails deep in the tokenizers library (a TypeError, a bare Exception) or as an
IndexError at the first request. Here each key is checked when the tokenizer is built, and a
problem is a one-line ModelError naming the file, the key and what is wrong with it.
"""
from __future__ import annotations

import math
import operator
from typing import Any

from engine.errors import ModelError
from engine.models.gguf_header import shown

TOKENS = "tokenizer.ggml.tokens"
TOKEN_TYPES = "tokenizer.ggml.token_type"
SCORES = "tokenizer.ggml.scores"
MERGES = "tokenizer.ggml.merges"
MODEL = "tokenizer.ggml.model"
STRING_KEYS = (MODEL, "tokenizer.ggml.pre", "tokenizer.chat_template")
TOKEN_TYPE_VALUES = range(7)   # llama.cpp's: undefined, normal, unknown, control, user-defined, unused, byte
# The longest piece of the supported vocabularies is 128 characters (Qwen2's); rebuilding merges
# from a SentencePiece vocabulary tries every cut of every piece, so pieces stay short.
MAX_TOKEN_CHARS = 1024
_REMEDY = "the file is corrupt or from an incompatible converter"


def check_tokenizer_metadata(md: dict[str, Any], where: str) -> None:
    """Raise ModelError unless every tokenizer key of `md` can be built into a tokenizer.
    `where` names the file (or the model) in the message."""
    for key in STRING_KEYS:
        if md.get(key) is not None and not isinstance(md[key], str):
            raise _bad(where, key, md[key], "a string")
    tokens = _checked_tokens(md, where)
    if md.get(MODEL) is None:
        raise ModelError(f"{where}: the file has no {MODEL} (which kind of tokenizer it uses); re-convert "
                         f"it with a recent llama.cpp convert_hf_to_gguf.py")
    template = md.get("tokenizer.chat_template")
    if template is not None and not _is_utf8(template):
        raise ModelError(f"{where}: metadata tokenizer.chat_template is not valid UTF-8; {_REMEDY}")
    n = len(tokens)
    for key, valid, what in ((TOKEN_TYPES, _is_token_type, f"a token type ({TOKEN_TYPE_VALUES[0]} to "
                                                           f"{TOKEN_TYPE_VALUES[-1]})"),
                             (SCORES, _is_score, "a number")):
        values = md.get(key)
        if values is None:
            continue
        if not isinstance(values, list):
            raise _bad(where, key, values, "a list of one entry per token")
        if len(values) != n:
            raise ModelError(f"{where}: metadata {key} has {len(values):,} entries but {TOKENS} has "
                             f"{n:,}: it must have one per token; {_REMEDY}")
        bad = next((i for i, v in enumerate(values) if not valid(v)), None)
        if bad is not None:
            raise ModelError(f"{where}: entry {bad} of metadata {key} is {shown(values[bad])}, not {what}; "
                             f"{_REMEDY}")
    merges = md.get(MERGES)
    if merges is not None:
        if not isinstance(merges, list):
            raise _bad(where, MERGES, merges, "a list of strings")
        bad = next((i for i, m in enumerate(merges) if type(m) is not str), None)
        if bad is not None:
            raise ModelError(f"{where}: entry {bad} of metadata {MERGES} is {shown(merges[bad])}, not a "
                             f"string; {_REMEDY}")
    for key, value in md.items():
        if value is None or not key.startswith("tokenizer.ggml."):
            continue
        if key.endswith("_token_id") and (type(value) is not int or not 0 <= value < n):
            raise _bad(where, key, value, f"a token id of the vocabulary ({TOKENS} has {n:,} tokens, "
                                          f"ids 0 to {n - 1:,})")
        if key.startswith("tokenizer.ggml.add_") and type(value) is not bool:
            raise _bad(where, key, value, "true or false")


def merge_pairs(merges: list[str], vocab: dict[str, int], where: str) -> list[tuple[str, str]]:
    """tokenizer.ggml.merges as the (left, right) pairs a BPE takes: each entry is two tokens
    joined by a space, and both, and the token they merge into, are in `vocab`."""
    pairs = [merge.partition(" ")[::2] for merge in merges]
    # in bulk first (151,387 merges in Qwen2's file); entry by entry only to name a bad one
    lefts, rights = zip(*pairs) if pairs else ((), ())
    parts = set(lefts) | set(rights)
    if "" not in parts and parts <= vocab.keys() and set(map(operator.add, lefts, rights)) <= vocab.keys():
        return pairs
    for i, merge in enumerate(merges):
        left, _, right = merge.partition(" ")
        if not left or not right:
            raise ModelError(f"{where}: entry {i} of metadata {MERGES} is {shown(merge)}, not two tokens "
                             f"separated by a space; {_REMEDY}")
        for piece, role in ((left, "names"), (right, "names"), (left + right, "merges into")):
            if piece not in vocab:
                raise ModelError(f"{where}: entry {i} of metadata {MERGES}, {shown(merge)}, {role} "
                                 f"{shown(piece)}, which is not in the vocabulary ({TOKENS}); {_REMEDY}")
    return pairs


def _checked_tokens(md: dict[str, Any], where: str) -> list[str]:
    tokens = md.get(TOKENS)
    if tokens is None or tokens == []:
        raise ModelError(f"{where}: the file has no {TOKENS}; it cannot be tokenized. Re-convert it "
                         f"with a recent llama.cpp convert_hf_to_gguf.py")
    if not isinstance(tokens, list):
        raise _bad(where, TOKENS, tokens, "a list of strings")
    for i, token in enumerate(tokens):
        if type(token) is not str:
            problem = "not a string"
        elif len(token) > MAX_TOKEN_CHARS:
            problem = f"{len(token):,} characters long (at most {MAX_TOKEN_CHARS:,} are accepted)"
        else:
            continue
        raise ModelError(f"{where}: entry {i} of metadata {TOKENS} is {shown(token)}, {problem}; {_REMEDY}")
    if not _is_utf8("".join(tokens)):    # one pass over all; the entry is looked for only if one is bad
        bad = next(i for i, token in enumerate(tokens) if not _is_utf8(token))
        raise ModelError(f"{where}: entry {bad} of metadata {TOKENS} is not valid UTF-8 "
                         f"({shown(tokens[bad])}); {_REMEDY}")
    return tokens


def _is_utf8(text: str) -> bool:
    """False when the header reader kept undecodable bytes as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_token_type(value: Any) -> bool:
    return type(value) is int and value in TOKEN_TYPE_VALUES


def _is_score(value: Any) -> bool:
    return type(value) in (int, float) and not math.isnan(value)


def _bad(where: str, key: str, value: Any, expected: str) -> ModelError:
    return ModelError(f"{where}: metadata {key} is {shown(value)}, but it must be {expected}; {_REMEDY}")
