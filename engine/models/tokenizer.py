"""GGUF tokenizer metadata → a `tokenizers.Tokenizer`, chat templates, and streaming detokenization.

A GGUF file carries no tokenizer.json, only llama.cpp's `tokenizer.*` keys. Two families matter here:

- `gpt2`: byte-level BPE (Qwen2, Llama 3). The merges are in the file; the split regex is named by
  `tokenizer.ggml.pre`.
- `llama`: SentencePiece BPE with byte fallback (Gemma 3). Files often list no merges, so they are
  rebuilt from the vocabulary, best piece first.

Control tokens (type 3) become special tokens and user-defined ones (type 4) plain added tokens, so
both are matched whole in the text and never cut by the BPE.

Text from users is never allowed to spell a control token: `encode()` reads `<|im_start|>` in a
prompt as the ten characters it is (unless the caller passes parse_special=True), and
`encode_chat()` makes only the chat template's own markers special, never a message's content.
Otherwise anyone could type `<|im_end|><|im_start|>system` and inject a turn.
"""

from __future__ import annotations

import re
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from engine.errors import InvalidRequest, ModelError
from engine.models.chat_template import TemplateFailed, TemplateOverBudget, render_chat_template
from engine.models.gguf import load_gguf
from engine.models.gguf_header import shown
from engine.models.tokenizer_metadata import check_tokenizer_metadata, merge_pairs

# llama.cpp's token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPIECE_SPACE = "\u2581"  # "▁": how SentencePiece spells a space

# Split regexes, as the models' own tokenizer.json files spell them.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
BPE_SPLITS = {
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "gpt2": _GPT2_SPLIT,
}

# Tokens that end a generation when the model emits them, besides tokenizer.ggml.eos_token_id.
_EOG_NAMES = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<eos>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",
              "<|end|>")   # Phi-3 ends a turn with <|end|>; its eos_token_id is <|endoftext|>
_EOG_ID_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
# Tokenizer.from_gguf: the live tokenizer of each model file in this process (resolved path)
_SHARED: dict[str, "weakref.ref[Tokenizer]"] = {}
_SHARED_LOCK = threading.Lock()

CHAT_ROLES = ("system", "user", "assistant", "tool")


class Tokenizer:
    """Encode, decode and render chats for one model, built from its GGUF metadata."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        model_name: str,
        tokens: list[str],
        token_types: list[int],
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        add_eos: bool,
        eog_ids: frozenset[int],
        chat_template: str | None,
    ) -> None:
        self.backend = backend
        self.model_name = model_name
        self._tokens = tokens
        self._types = token_types
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.eog_ids = eog_ids
        self.chat_template = chat_template
        self._special_ids = {t: i for i, (t, k) in enumerate(zip(tokens, token_types)) if k == CONTROL and t}
        self._special_re: re.Pattern | None = None
        # The backend always reads control tokens as plain text; parse_special cuts the text at
        # them first (_encode_ids). Never switched, the backend is shared by threads without a
        # lock, so a long encode in one thread never holds up another's.
        self.backend.encode_special_tokens = True
        # Most UTF-8 bytes of text one token can stand for (its vocabulary spelling is never
        # shorter): a text longer than context * this cannot fit, whatever it encodes to.
        self.max_token_bytes = max((len(t.encode("utf-8", "surrogatepass")) for t in tokens), default=1) or 1

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path, metadata: dict[str, Any] | None = None) -> Tokenizer:
        """The tokenizer of a model file, shared by everything in this process that asks for
        the same file while one is alive (it never changes once built, and encoding is
        thread-safe): in thread mode the engine and its workers hold one copy, not one each
        (~55 MB apiece with a 152k vocabulary). `metadata`: the file's, when already read."""
        key = str(Path(path).resolve())
        with _SHARED_LOCK:
            ref = _SHARED.get(key)
            tok = ref() if ref is not None else None
            if tok is None:
                tok = cls.from_metadata(metadata if metadata is not None else load_gguf(path).metadata, path)
                _SHARED[key] = weakref.ref(tok)
            return tok

    @classmethod
    def from_metadata(cls, md: dict[str, Any], source: str | Path | None = None) -> Tokenizer:
        """Build from decoded GGUF metadata (key → str / int / bool / float / list), its
        tokenizer keys checked first (engine/models/tokenizer_metadata.py). `source`: the file
        it was read from, which a ModelError names."""
        name = str(md.get("general.name") or md.get("general.architecture") or "this model")
        where = str(source) if source is not None else f"model {name}"
        check_tokenizer_metadata(md, where)
        kind = md.get("tokenizer.ggml.model")
        tokens = list(md["tokenizer.ggml.tokens"])
        types = list(md.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
        if kind == "gpt2":
            backend = _byte_level_bpe(md, tokens, where)
            default_add_bos = False
        elif kind == "llama":
            backend = _sentencepiece_bpe(md, tokens, where)
            default_add_bos = True  # llama.cpp's default for SentencePiece vocabularies
        else:
            raise ModelError(f"{where}: tokenizer type {shown(kind)} (metadata tokenizer.ggml.model) is not supported "
                             "(only 'gpt2' byte-level BPE and 'llama' SentencePiece BPE are). "
                             "Use a Qwen2, Llama 3 or Gemma 3 GGUF.")
        _add_special_tokens(backend, tokens, types)

        bos_id = md.get("tokenizer.ggml.bos_token_id")
        eos_id = md.get("tokenizer.ggml.eos_token_id")
        by_name = {tok: i for i, tok in enumerate(tokens) if types[i] in (CONTROL, USER_DEFINED)}
        eog = {md[k] for k in _EOG_ID_KEYS if md.get(k) is not None}
        eog |= {by_name[t] for t in _EOG_NAMES if t in by_name}
        return cls(
            backend,
            model_name=name,
            tokens=tokens,
            token_types=types,
            bos_id=bos_id,
            eos_id=eos_id,
            add_bos=bool(md.get("tokenizer.ggml.add_bos_token", default_add_bos)) and bos_id is not None,
            add_eos=bool(md.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None,
            eog_ids=frozenset(eog),
            chat_template=md.get("tokenizer.chat_template") or None,
        )

    # ---- tokens -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`. A special token written in the text (e.g. <|im_start|>) is plain
        text, unless parse_special (trusted text only: it lets the text forge turns).
        With add_special, BOS/EOS are added when the model asks for them."""
        ids = self._encode_ids(text, parse_special)
        if add_special and self.add_bos:
            ids.insert(0, self.bos_id)
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    def _encode_ids(self, text: str, parse_special: bool) -> list[int]:
        """The backend's ids for text; control tokens spelled in it are matched whole only
        with parse_special, else they are plain text to the BPE."""
        pattern = self._special_pattern() if parse_special else None
        if pattern is None:
            return self._plain_ids([text])
        ids: list[int] = []
        for i, piece in enumerate(pattern.split(text)):
            if i % 2:                # split() puts each match between the plain pieces
                ids.append(self._special_ids[piece])
            elif piece:
                ids += self._plain_ids([piece])
        return ids

    def _plain_ids(self, texts: list[str]) -> list[int]:
        """The ids of texts encoded one after another, control tokens read as plain text.
        encode_batch, unlike encode, releases the GIL while it works: a megabyte of prompt
        (seconds of BPE) leaves the caller's other threads - the HTTP event loop - running."""
        try:
            encodings = self.backend.encode_batch(texts, add_special_tokens=False)
        except TypeError:
            bad = next((t for t in texts if not _is_unicode(t)), None)
            if bad is None:
                raise
            raise InvalidRequest("the text holds a lone UTF-16 surrogate (e.g. \\ud800), which is not "
                                 "Unicode; send valid UTF-8 text") from None
        return [i for enc in encodings for i in enc.ids]

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_str(self, token_id: int) -> str:
        """The vocabulary entry as the model file spells it ('Ġworld', '▁world', '<0x0A>'); decode([id]) gives text."""
        return self._tokens[token_id]

    def is_special(self, token_id: int) -> bool:
        return self._types[token_id] == CONTROL

    def is_byte_fallback(self, token_id: int) -> bool:
        return self._types[token_id] == BYTE

    # ---- chat ---------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """Render `messages` with the model's own chat template, in a sandbox (the template is untrusted)."""
        if self.chat_template is None:
            raise InvalidRequest(f"model {self.model_name} has no chat template; send a plain prompt "
                                 "instead of chat messages (it is a base model: it continues text), or pick an instruct model.")
        validate_messages(messages)
        try:
            return render_chat_template(self.chat_template, {
                "messages": messages, "add_generation_prompt": add_generation_prompt,
                "tools": None, "documents": None,
                "bos_token": self._token_or_empty(self.bos_id),
                "eos_token": self._token_or_empty(self.eos_id)})
        except TemplateOverBudget as e:
            raise InvalidRequest(f"the chat template of model {self.model_name} was stopped: {e}; "
                                 "the model file's template is broken or hostile, replace it") from None
        except TemplateFailed as e:  # the template is foreign code: a failure in it refuses the request
            raise InvalidRequest(f"the chat template of model {self.model_name} refused these messages: {e}") from None

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat rendered by the model's template. Only the template's own markers
        are special tokens: a control token spelled inside a message's content stays plain text.

        Each control token in the contents is swapped for a private-use sentinel before rendering
        (so the template treats the content as usual), then the rendered text is cut at the
        control tokens left - the template's - and every other piece, sentinels restored, is
        encoded as plain text. That is how the backend itself cuts text at added tokens."""
        validate_messages(messages)
        pattern = self._special_pattern()
        used = "".join(m["content"] for m in messages) + (self.chat_template or "")
        mark = next(chr(c) for c in range(0xE000, 0xF900) if chr(c) not in used)
        originals: list[str] = []

        def hide(m: re.Match) -> str:
            originals.append(m.group())
            return f"{mark}{len(originals) - 1}{mark}"

        hidden = [{**m, "content": pattern.sub(hide, m["content"])} if pattern else m for m in messages]
        text = self.apply_chat_template(hidden, add_generation_prompt=add_generation_prompt)
        unhide = re.compile(f"{mark}(\\d+){mark}")
        ids: list[int] = []
        for i, piece in enumerate(pattern.split(text) if pattern else [text]):
            if i % 2:
                ids.append(self._special_ids[piece])
            elif piece:
                ids += self._plain_ids([unhide.sub(lambda m: originals[int(m.group(1))], piece)])
        return ids

    def _special_pattern(self) -> re.Pattern | None:
        """Matches any control token, longest first (the split keeps the matches)."""
        if self._special_re is None and self._special_ids:
            alternatives = sorted(self._special_ids, key=len, reverse=True)
            self._special_re = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")
        return self._special_re

    def _token_or_empty(self, token_id: int | None) -> str:
        return self._tokens[token_id] if token_id is not None else ""


def _is_unicode(text: str) -> bool:
    """False when text holds a lone surrogate (JSON's "\\ud800" decodes to one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def validate_messages(messages: Any) -> None:
    """Raise InvalidRequest unless `messages` is a non-empty list of {role, content: str} dicts."""
    if not isinstance(messages, list):
        raise InvalidRequest(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                             f"got {type(messages).__name__}.")
    if not messages:
        raise InvalidRequest("messages is empty; send at least one {'role': 'user', 'content': ...} message.")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be a dict with 'role' and 'content', "
                                 f"got {type(message).__name__}.")
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}]['role'] is {role!r}; use one of {', '.join(CHAT_ROLES)}.")
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}]['content'] must be a string, got {type(content).__name__}.")


# ---- building the backend -------------------------------------------------------------------


def _byte_level_bpe(md: dict, tokens: list[str], where: str) -> tokenizers.Tokenizer:
    pre = md.get("tokenizer.ggml.pre", "gpt2")
    split = BPE_SPLITS.get(pre)
    if split is None:
        raise ModelError(f"{where}: pre-tokenizer {shown(pre)} (metadata tokenizer.ggml.pre) is not supported "
                         f"(known: {', '.join(BPE_SPLITS)}); its text would be split differently from "
                         "training. Use a Qwen2 or Llama 3 GGUF.")
    merges = md.get("tokenizer.ggml.merges")
    if not merges:
        raise ModelError(f"{where}: a byte-level BPE file must list tokenizer.ggml.merges; re-convert the model.")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=merge_pairs(merges, vocab, where),
                                       fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(md: dict, tokens: list[str], where: str) -> tokenizers.Tokenizer:
    """SentencePiece BPE: spaces become ▁, unknown characters fall back to <0xNN> byte tokens."""
    # Gemma files store pieces made only of spaces with real spaces; the text they match has ▁ instead.
    tokens = [SPIECE_SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = md.get("tokenizer.ggml.merges")
    if merges:
        merges = merge_pairs(merges, vocab, where)
    else:
        # Gemma's scores do not follow the order its merges were learned in; its vocabulary order does.
        by_position = str(md.get("general.architecture", "")).startswith("gemma")
        scores = None if by_position else md.get("tokenizer.ggml.scores")
        merges = _merges_from_vocab(tokens, vocab, scores)
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                                       unk_token=tokens[unk_id] if unk_id is not None else None))
    decode_steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if md.get("tokenizer.ggml.add_space_prefix", True):
        # Llama-2 style: "▁" before the text so the first word looks like every other word.
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPIECE_SPACE),
                                                   normalizers.Replace(" ", SPIECE_SPACE)])
        decode_steps.append(decoders.Strip(" ", 1, 0))
    else:
        backend.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
    backend.decoder = decoders.Sequence(decode_steps)
    return backend


def _merges_from_vocab(tokens: list[str], vocab: dict[str, int],
                       scores: list[float] | None) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, best piece first (highest score, or
    earliest position when there are no usable scores), longer left part first within a piece."""
    order = range(len(tokens))
    if scores is not None:
        order = sorted(order, key=lambda i: -scores[i])  # stable: equal scores keep vocabulary order
    merges = []
    seen = set()
    for i in order:
        piece = tokens[i]
        if piece in seen:
            continue
        seen.add(piece)
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def _add_special_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens become special tokens, user-defined ones plain added tokens: both are matched
    whole in the raw text (before any normalization) instead of being cut into pieces."""
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    # A SentencePiece run of spaces is a vocabulary piece of ▁ (see _sentencepiece_bpe): the BPE makes it.
    plain = [AddedToken(t, special=False, normalized=False)
             for t, k in zip(tokens, types) if k == USER_DEFINED and t.strip(" ")]
    backend.add_special_tokens(special)
    backend.add_tokens(plain)


# ---- streaming detokenization ---------------------------------------------------------------


@dataclass
class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces that are always whole characters.

    A byte-level token can end in the middle of a UTF-8 character, and a run of <0xNN> byte tokens
    decodes as a unit; so text is released only once the window's tail decodes cleanly. Only a short
    window (prefix_offset..) is re-decoded per token, like vLLM's prefix/read offsets. The pieces
    returned by push() and flush() concatenate to decode(all ids).
    """

    tokenizer: Tokenizer
    skip_special: bool = False

    def __post_init__(self) -> None:
        self.ids: list[int] = []
        self._prefix_offset = 0  # start of the window re-decoded for context
        self._read_offset = 0  # end of the text already returned

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.tokenizer.is_byte_fallback(token_id) or (self.skip_special and self.tokenizer.is_special(token_id)):
            # A run of <0xNN> tokens decodes as one unit (a skipped special token does not end it):
            # wait for the run to end.
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self.ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing new yet, or a character still incomplete
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes as U+FFFD, like decode())."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self.ids))
        self._prefix_offset = self._read_offset = len(self.ids)
        return new_text[len(prefix_text):]

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special=self.skip_special)
