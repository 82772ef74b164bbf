"""GGUF fuzzing: corrupted headers either load or are refused in one line, quickly, in bounded memory.

Hypothesis corrupts the header of tiny random models (qwen2 with K-quants, gemma3, llama)
and of the real bundled Qwen2.5-Coder-0.5B: a field set to a boundary or random value (counts,
lengths, value types, metadata values, tensor dimensions, types and offsets), flipped bytes,
bytes cut out or put in, the file cut short. It also rewrites their tokenizer metadata
(tokenizer.*): token ids, flags and names set to boundary values or other types, entries of
the vocabulary, token types, merges and scores replaced, keys dropped, the vocabulary made a
SentencePiece one. Each file is loaded in a child process (tests/fixtures/load_probe.py) and
its tokenizer built from it (and used a little), and must load, or raise the engine's user
error (a TokentopError) with one line that names the file, within 10 s and 1 GiB. A tiny model
whose header mutations load is also built into a Decoder, self-checked and run for one step:
a refusal must come before that step.

Seeded (the same examples every run) and sized for CI: TOKENTOP_FUZZ_EXAMPLES=N runs N
examples of each kind on the tiny models, N/5 header mutations and N/20 tokenizer rewrites of
the real file (TOKENTOP_FUZZ_SEED=S draws other ones); TOKENTOP_FUZZ_REPORT=FILE writes the
outcomes, refusals grouped by message, as JSON.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import pytest
from gguf import GGMLQuantizationType, GGUFValueType as V
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from engine.models.gguf_header import shown
from engine.models.tokenizer import BPE_SPLITS
from engine.models.tokenizer_metadata import MAX_TOKEN_CHARS
from tests.fixtures.gguf_fields import Field, HeaderFields, header_fields
from tests.fixtures.gguf_metadata import Entry, MetadataFile
from tests.fixtures.load_probe import LoadProbe, acceptable
from tests.fixtures.tiny_gguf import write_tiny_model

TINY_EXAMPLES = int(os.environ.get("TOKENTOP_FUZZ_EXAMPLES", "300"))
REAL_EXAMPLES = max(5, TINY_EXAMPLES // 5)     # each parses a 151,936-token vocabulary
REAL_TOKENIZER_EXAMPLES = max(3, TINY_EXAMPLES // 20)   # each also builds its tokenizer (~2 s)
FUZZ_SEED = os.environ.get("TOKENTOP_FUZZ_SEED")
REAL_DATA_KEPT = 1 << 20    # of the real file's tensor data, this much is copied after the header

BOUNDARY_INTS = [0, 1, 2, 3, 4, 5, 8, 31, 32, 33, 63, 64, 255, 256, 1023, 4096, 65535, 65536,
                 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
BOUNDARY_FLOATS = [0.0, -0.0, -1.0, 1e-30, 1e30, 3.4e38, math.inf, -math.inf, math.nan]
GGML_TYPES = [int(t) for t in GGMLQuantizationType]
# How often each kind of field is picked: more for those the loader checks against each other
# (metadata values, tensor shapes, types, offsets) than for those any reader refuses at once.
FIELD_WEIGHTS = {"value": 6, "dim": 4, "type": 4, "offset": 3, "array_length": 2, "n_dims": 2,
                 "string_length": 1, "tensor_count": 1, "kv_count": 1, "key_length": 1,
                 "value_type": 1, "array_type": 1, "name_length": 1, "version": 1}
_RANGES = {"B": (0, 2**8 - 1), "b": (-2**7, 2**7 - 1), "H": (0, 2**16 - 1), "h": (-2**15, 2**15 - 1),
           "I": (0, 2**32 - 1), "i": (-2**31, 2**31 - 1), "Q": (0, 2**64 - 1), "q": (-2**63, 2**63 - 1)}

pytestmark = pytest.mark.slow


class Outcomes:
    """What the examples of one test gave, for the report."""

    def __init__(self, name: str):
        self.name, self.results, self.messages = name, Counter(), Counter()

    def add(self, result: dict, path: Path) -> None:
        self.results[result["outcome"] if result["outcome"] != "refused" else f"refused at {result['stage']}"] += 1
        if result["outcome"] == "refused":
            self.messages[_message_group(result["message"], path)] += 1

    def summary(self) -> dict:
        return {"examples": sum(self.results.values()), "outcomes": dict(self.results.most_common()),
                "refusals": dict(self.messages.most_common())}


def _message_group(message: str, path: Path) -> str:
    """A refusal without its particulars: file, numbers, names and values."""
    text = message.replace(str(path), "FILE")
    text = re.sub(r"'[^']*(?:'|\.\.\.)|\"[^\"]*(?:\"|\.\.\.)", "'…'", text)    # names and values
    text = re.sub(r"\([\d, ]+\)", "(N)", text)                                      # shapes
    return re.sub(r"(?<![A-Za-z_\d])-?\d(?:[\d,]*\d)?(?:\.\d+)?(?:e[+-]?\d+)?", "N", text)


def _report(outcomes: Outcomes) -> None:
    summary = outcomes.summary()
    print(f"\n{outcomes.name}: {json.dumps(summary, indent=1, ensure_ascii=False)}")
    target = os.environ.get("TOKENTOP_FUZZ_REPORT")
    if target:
        path = Path(target)
        previous = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps({**previous, outcomes.name: summary}, indent=1, ensure_ascii=False))


# --- mutations -----------------------------------------------------------------------------

def _field_value(draw, f: Field, data: bytes):
    code = f.fmt[-1]
    if code in "fd":
        return draw(st.sampled_from(BOUNDARY_FLOATS) | st.floats(width=32 if code == "f" else 64))
    if code == "?":
        return None                                    # a bool: a byte flip covers it
    old = f.read(data)
    low, high = _RANGES[code]
    near = [old - 1, old + 1, old * 2, old // 2, old + 32, old - 32]
    candidates = BOUNDARY_INTS + near + (GGML_TYPES if f.kind == "type" else [])
    value = draw(st.sampled_from(candidates) | st.integers(low, high))
    return min(max(value, low), high)


@st.composite
def mutations(draw, data: bytes, by_kind: dict[str, list[Field]]):
    """A list of 1-3 corruptions of `data`, as (kind, offset, payload). Each is aimed at a
    header field: its value replaced, one of its bytes flipped, or bytes cut out or put in
    there; or the file is cut short anywhere."""
    kinds = [k for k in FIELD_WEIGHTS for _ in range(FIELD_WEIGHTS[k]) if k in by_kind]
    out = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["field", "field", "field", "bytes", "splice", "truncate"]))
        if kind == "truncate":
            out.append(("truncate", draw(st.integers(0, len(data) - 1)), None))
            continue
        f = draw(st.sampled_from(by_kind[draw(st.sampled_from(kinds))]))
        value = _field_value(draw, f, data) if kind == "field" else None
        at = f.offset + draw(st.integers(0, f.size - 1))
        if value is not None:
            out.append(("field", f.offset, struct.pack(f.fmt, value)))
        elif kind == "splice":
            out.append(("splice", at, (draw(st.integers(0, 16)), draw(st.binary(max_size=16)))))
        else:
            out.append(("bytes", at, bytes([draw(st.integers(1, 255))])))
    return out


def apply(data: bytes, muts: list) -> bytearray:
    """In place first (offsets are the original file's), then splices from the back, then cuts."""
    out = bytearray(data)
    for kind, at, payload in muts:
        if kind == "field":
            out[at:at + len(payload)] = payload
        elif kind == "bytes":
            out[at] ^= payload[0]
    for kind, at, payload in sorted((m for m in muts if m[0] == "splice"), key=lambda m: -m[1]):
        delete, insert = payload
        out[at:at + delete] = insert
    cuts = [at for kind, at, _ in muts if kind == "truncate"]
    if cuts:
        del out[min(cuts):]
    return out


def _by_kind(fields: HeaderFields) -> dict[str, list[Field]]:
    """Fields grouped by kind: an example picks a kind first, so the few counts are drawn as
    often as the 300,000 string lengths of a vocabulary."""
    groups: dict[str, list[Field]] = {}
    for f in fields:
        groups.setdefault(f.kind, []).append(f)
    return groups


def _settings(examples: int):
    def decorate(test):
        # no shrinking: an example is at most three corruptions already, and one that hangs
        # costs the 10 s deadline and a fresh child each time it is tried
        test = settings(max_examples=examples, derandomize=FUZZ_SEED is None, database=None, deadline=None,
                        phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
                        print_blob=True)(test)
        return seed(int(FUZZ_SEED))(test) if FUZZ_SEED is not None else test
    return decorate


# --- tiny models: every header field, then build and one step --------------------------------

TINY_ARCHS = {
    "qwen2": dict(hidden=256, ffn=512, n_heads=4, head_dim=64),   # K-quants and every other type
    "gemma3": dict(n_layers=6),                                  # sliding windows, tied embeddings
    "llama": dict(),
}


@pytest.fixture(scope="module")
def tiny_bases(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz-tiny")
    bases = {}
    for arch, kwargs in TINY_ARCHS.items():
        data = write_tiny_model(folder / f"{arch}.gguf", arch, **kwargs).read_bytes()
        fields = header_fields(data)
        bases[arch] = (data, fields, _by_kind(fields))
    return folder, bases


@pytest.fixture(scope="module")
def building_probe():
    with LoadProbe(build=True) as probe:
        yield probe


def test_fuzzed_tiny_models_load_or_are_refused_in_one_line(tiny_bases, building_probe):
    folder, bases = tiny_bases
    outcomes = Outcomes("tiny models (qwen2, gemma3, llama): header mutations, load + tokenizer + build + one step")
    target = folder / "mutated.gguf"

    @_settings(TINY_EXAMPLES)
    @given(st.data())
    def check(draw):
        arch = draw.draw(st.sampled_from(sorted(bases)), label="arch")
        data, fields, by_kind = bases[arch]
        muts = draw.draw(mutations(data, by_kind), label="mutations")
        target.write_bytes(apply(data, muts))
        result = building_probe.load(target)
        outcomes.add(result, target)
        problem = acceptable(result, target)
        assert problem is None, problem

    try:
        check()
    finally:
        _report(outcomes)
    assert outcomes.results["loaded"] > 0 and sum(outcomes.messages.values()) > 0


# --- tokenizer metadata: values rewritten, the tokenizer built from each file ------------------

TOKENS, TOKEN_TYPES, MERGES, SCORES = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                       "tokenizer.ggml.merges", "tokenizer.ggml.scores")
TOKEN_ID_KEYS = [f"tokenizer.ggml.{name}_token_id"
                 for name in ("bos", "eos", "eot", "eom", "padding", "unknown", "sep", "cls", "mask")]
FLAG_KEYS = [f"tokenizer.ggml.{name}" for name in ("add_bos_token", "add_eos_token", "add_space_prefix",
                                                   "add_sep_token")]
MODELS = ["gpt2", "llama", "bert", "t5", "rwkv", "ugm", "", "GPT2"]
PRES = sorted(BPE_SPLITS) + ["default", "starcoder", ""]
TEMPLATES = ["", "{{", "{% for m in messages %}{{ m['content'] }}{% endfor %}", b"\xff{{ x }}", "\u2581" * 64]
# A piece of the vocabulary or of a merge: empty, spaces, invalid UTF-8, too long, a special token...
PIECES = ["", " ", "  ", b"\xff", b"\xc3", "x" * MAX_TOKEN_CHARS, "x" * (MAX_TOKEN_CHARS + 1), "<|im_end|>",
          "\u2581", "\u2581\u2581", "<0x0A>", "a b", "\n", "\x00"]
MERGE_TEXTS = ["he", "h  e", " h e", "h e ", "", " ", "x@ y#", "h l", "Ġt he", b"\xff e", "Ġ Ġ"]
TOKEN_TYPE_VALUES = [0, 1, 2, 3, 4, 5, 6, 7, 255, -1, 2**31 - 1]
# How often each kind of rewrite is picked; "spm" makes the vocabulary a SentencePiece one
# without merges, so that they are rebuilt from it.
REWRITE_WEIGHTS = {"token_id": 4, "flag": 2, "name": 3, "drop": 2, "token": 3, "token_type": 3,
                   "merge": 3, "merges": 1, "scores": 2, "retype": 2, "spm": 2}
_INT_TYPES = {V.UINT8: (0, 2**8 - 1), V.INT8: (-2**7, 2**7 - 1), V.UINT32: (0, 2**32 - 1),
              V.INT32: (-2**31, 2**31 - 1), V.UINT64: (0, 2**64 - 1), V.INT64: (-2**63, 2**63 - 1)}
_OTHER_TYPES = [Entry(V.UINT32, 7), Entry(V.INT32, -1), Entry(V.FLOAT32, 1.5), Entry(V.BOOL, True),
                Entry(V.STRING, "gpt2"), Entry(V.ARRAY, [1, 2, 3], V.INT32), Entry(V.ARRAY, ["h e"], V.STRING),
                Entry(V.ARRAY, [0.5], V.FLOAT32)]


def _number_entry(draw, value: int) -> Entry:
    """`value` written as some GGUF scalar type (an integer one mostly, as in real files)."""
    vtype = draw(st.sampled_from([V.UINT32] * 4 + list(_INT_TYPES) + [V.FLOAT32, V.BOOL, V.STRING]))
    if vtype in _INT_TYPES:
        low, high = _INT_TYPES[vtype]
        return Entry(vtype, min(max(value, low), high))
    return Entry(vtype, {V.FLOAT32: float, V.BOOL: bool, V.STRING: str}[vtype](value))


def _piece(draw, pieces: list, vocabulary: list[str]):
    return draw(st.sampled_from(pieces) | st.sampled_from(vocabulary) | st.text(max_size=8))


class Rewritten(NamedTuple):
    """Rewritten metadata, shown as what was changed (a failing example would print a whole
    vocabulary otherwise)."""
    entries: dict[str, Entry]
    changes: list[str]

    def __repr__(self) -> str:
        return f"Rewritten({'; '.join(self.changes)})"


@st.composite
def tokenizer_rewrites(draw, entries: dict[str, Entry]) -> Rewritten:
    """`entries` with 1-3 of its tokenizer keys rewritten."""
    out, changes = dict(entries), []
    tokens = entries[TOKENS].value
    n = len(tokens)
    kinds = [k for k, w in REWRITE_WEIGHTS.items() for _ in range(w)]

    def array(key: str, values: list, item_type: V, change: str) -> None:
        out[key] = Entry(V.ARRAY, values, item_type)
        changes.append(f"{key}: {change}")

    def replace(key: str, entry: Entry) -> None:
        out[key] = entry
        changes.append(f"{key} = {entry.type.name} {shown(entry.value)}")

    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(kinds))
        present = sorted(k for k in out if k.startswith("tokenizer."))
        strings = {k for k in (TOKENS, MERGES) if k in out and out[k].item_type == V.STRING}
        if kind == "token_id":
            value = draw(st.sampled_from([0, 1, n - 2, n - 1, n, n + 1, 2**31 - 1, 2**32 - 1, -1])
                         | st.integers(0, 2 * n))
            replace(draw(st.sampled_from(TOKEN_ID_KEYS)), _number_entry(draw, value))
        elif kind == "flag":
            replace(draw(st.sampled_from(FLAG_KEYS)), draw(st.sampled_from(
                [Entry(V.BOOL, True), Entry(V.BOOL, False), Entry(V.UINT8, 1), Entry(V.INT32, 0),
                 Entry(V.STRING, "false")])))
        elif kind == "name":
            key, choices = draw(st.sampled_from([("tokenizer.ggml.model", MODELS), ("tokenizer.ggml.pre", PRES),
                                                 ("tokenizer.chat_template", TEMPLATES)]))
            replace(key, Entry(V.STRING, draw(st.sampled_from(choices))))
        elif kind == "drop" and present:
            key = draw(st.sampled_from(present))
            del out[key]
            changes.append(f"{key} dropped")
        elif kind == "token" and TOKENS in strings:
            values = list(out[TOKENS].value)
            i = draw(st.integers(0, len(values) - 1))
            values[i] = _piece(draw, PIECES, tokens)
            array(TOKENS, values, V.STRING, f"entry {i} = {shown(values[i])}")
        elif kind == "token_type" and TOKEN_TYPES in out:
            values = list(out[TOKEN_TYPES].value)
            change = draw(st.sampled_from(["entry", "entry", "shorter", "longer"]))
            if change == "entry":
                i = draw(st.integers(0, len(values) - 1))
                values[i] = draw(st.sampled_from(TOKEN_TYPE_VALUES))
                change = f"entry {i} = {values[i]}"
            else:
                values = values[:-1] if change == "shorter" else values + [1]
            array(TOKEN_TYPES, values, V.INT32, change)
        elif kind == "merge" and MERGES in strings:
            values = list(out[MERGES].value)
            i = draw(st.integers(0, len(values) - 1))
            values[i] = _piece(draw, MERGE_TEXTS, values)
            array(MERGES, values, V.STRING, f"entry {i} = {shown(values[i])}")
        elif kind == "merges" and MERGES in strings:
            values = list(out[MERGES].value)
            change = draw(st.sampled_from(["halved", "repeated", "reversed"]))
            values = {"halved": values[:len(values) // 2], "repeated": values + values,
                      "reversed": values[::-1]}[change]
            array(MERGES, values, V.STRING, change)
        elif kind == "scores":
            length = draw(st.sampled_from([n, n, n, n - 1, n + 1]))
            item_type = draw(st.sampled_from([V.FLOAT32, V.FLOAT32, V.FLOAT64, V.INT32]))
            values = [-i for i in range(length)] if item_type == V.INT32 else [-float(i) for i in range(length)]
            change = f"{length} of {item_type.name}"
            if item_type != V.INT32 and draw(st.booleans()):
                i = draw(st.integers(0, length - 1))
                values[i] = draw(st.sampled_from(BOUNDARY_FLOATS))
                change += f", entry {i} = {values[i]}"
            array(SCORES, values, item_type, change)
        elif kind == "retype" and present:
            replace(draw(st.sampled_from(present)), draw(st.sampled_from(_OTHER_TYPES)))
        elif kind == "spm":
            out["tokenizer.ggml.model"] = Entry(V.STRING, "llama")
            out.pop(MERGES, None)
            changes.append("SentencePiece, no merges")
    return Rewritten(out, changes)


@pytest.fixture(scope="module")
def tiny_metadata_files(tiny_bases):
    folder, bases = tiny_bases
    return folder, {arch: MetadataFile(data) for arch, (data, _, _) in bases.items()}


@pytest.fixture(scope="module")
def tokenizer_probe():
    with LoadProbe(tokenizer=True) as probe:
        yield probe


def test_fuzzed_tokenizer_metadata_builds_or_is_refused_in_one_line(tiny_metadata_files, tokenizer_probe):
    folder, files = tiny_metadata_files
    outcomes = Outcomes("tiny models (qwen2, gemma3, llama): tokenizer metadata rewrites, load + tokenizer")
    target = folder / "rewritten.gguf"

    @_settings(TINY_EXAMPLES)
    @given(st.data())
    def check(draw):
        source = files[draw.draw(st.sampled_from(sorted(files)), label="arch")]
        rewritten = draw.draw(tokenizer_rewrites(source.entries), label="metadata")
        target.write_bytes(source.with_metadata(rewritten.entries))
        result = tokenizer_probe.load(target)
        outcomes.add(result, target)
        problem = acceptable(result, target)
        assert problem is None, problem

    try:
        check()
    finally:
        _report(outcomes)
    assert outcomes.results["loaded"] > 0 and outcomes.results["refused at tokenizer"] > 0


# --- the real model's header: mutated header + the start of the real data, the rest a hole ---

@pytest.fixture(scope="module")
def real_header(real_model_path):
    with open(real_model_path, "rb") as f:
        head = f.read(16 << 20)                   # the 0.5B's header is ~5.9 MB
    fields = header_fields(head)
    data_start = -(-fields.end // 32) * 32
    prefix = head[:data_start + REAL_DATA_KEPT]
    return prefix, fields, _by_kind(fields), real_model_path.stat().st_size


@pytest.fixture(scope="module")
def loading_probe():
    with LoadProbe(tokenizer=True) as probe:
        yield probe


@pytest.mark.realmodel
def test_fuzzed_real_model_header_loads_or_is_refused_in_one_line(real_header, loading_probe, tmp_path_factory):
    """The loader never reads tensor bytes, only their sizes and places: so after the mutated
    header and the first MiB of the real data, the file is a hole of the real length (sparse:
    nothing is written), instead of copying 491 MB for each example."""
    prefix, _, by_kind, size = real_header
    outcomes = Outcomes("qwen2.5-coder-0.5b header mutations, load + tokenizer")
    target = tmp_path_factory.mktemp("fuzz-real") / "mutated.gguf"

    @_settings(REAL_EXAMPLES)
    @given(mutations(prefix, by_kind))
    def check(muts):
        mutated = apply(prefix, muts)
        cut = any(kind == "truncate" for kind, _, _ in muts)
        with open(target, "wb") as f:
            f.write(mutated)
            if not cut:
                f.truncate(size + len(mutated) - len(prefix))
        result = loading_probe.load(target)
        outcomes.add(result, target)
        problem = acceptable(result, target)
        assert problem is None, problem

    try:
        check()
    finally:
        _report(outcomes)


@pytest.mark.realmodel
def test_the_real_header_with_its_hole_loads(real_header, loading_probe, tmp_path):
    """The fuzzer's stand-in for the real file loads as the real file does: its mutations are
    what gets refused."""
    prefix, _, _, size = real_header
    target = tmp_path / "unmutated.gguf"
    with open(target, "wb") as f:
        f.write(prefix)
        f.truncate(size)
    result = loading_probe.load(target)
    assert result["outcome"] == "loaded", result


@pytest.mark.realmodel
def test_fuzzed_real_tokenizer_metadata_builds_or_is_refused_in_one_line(real_header, loading_probe,
                                                                         tmp_path_factory):
    """The real vocabulary (151,936 tokens, 151,387 merges) rewritten as the tiny ones are: its
    checks and its build stay within the deadline and the memory limit too."""
    prefix, _, _, size = real_header
    source = MetadataFile(prefix)
    outcomes = Outcomes("qwen2.5-coder-0.5b tokenizer metadata rewrites, load + tokenizer")
    target = tmp_path_factory.mktemp("fuzz-real-tokenizer") / "rewritten.gguf"

    @_settings(REAL_TOKENIZER_EXAMPLES)
    @given(tokenizer_rewrites(source.entries))
    def check(rewrite):
        rewritten = source.with_metadata(rewrite.entries)
        with open(target, "wb") as f:
            f.write(rewritten)
            f.truncate(size + len(rewritten) - len(prefix))
        result = loading_probe.load(target)
        outcomes.add(result, target)
        problem = acceptable(result, target)
        assert problem is None, problem

    try:
        check()
    finally:
        _report(outcomes)
