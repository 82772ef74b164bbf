"""GGUF loading: config from metadata, zero-copy tensors, and clear errors for broken files."""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from engine.errors import ModelError
from engine.models.gguf import SUPPORTED_ARCHS, load_gguf
from tests.fixtures.gguf_fields import corrupted, header_fields
from tests.fixtures.load_probe import LoadProbe, acceptable
from tests.fixtures.tiny_gguf import tiny_vocab


def reader_view(path):
    """What gguf-py's own reader sees, as the reference for our header parser."""
    r = gguf.GGUFReader(str(path))
    md = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return md, r.tensors


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_metadata_and_tensors_match_gguf_reader(tiny_model_path, arch):
    path = tiny_model_path(arch)
    gf = load_gguf(path)
    md, tensors = reader_view(path)
    assert gf.metadata == md
    assert [t.name for t in tensors] == list(gf.tensors)
    for t in tensors:
        td = gf.tensors[t.name]
        assert td.ggml_type == t.tensor_type
        assert td.shape == tuple(reversed(t.shape.tolist()))
        assert td.raw.dtype == np.uint8 and td.raw.nbytes == t.n_bytes
        assert np.array_equal(td.raw.reshape(-1), t.data.view(np.uint8).reshape(-1))
        assert np.shares_memory(td.raw, gf.tensors["token_embd.weight"].raw) == (t.name == "token_embd.weight")


def test_qwen2_config(tiny_model_path):
    c = load_gguf(tiny_model_path("qwen2", n_layers=3, hidden=64, n_heads=4, n_kv_heads=2,
                                  head_dim=16, ffn=96, context_length=128)).config
    assert (c.arch, c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim) == \
        ("qwen2", 3, 64, 4, 2, 16, 96)
    assert c.context_length == 128 and c.vocab_size == len(c.metadata["tokenizer.ggml.tokens"])
    assert c.rope_base == c.rope_local_base == 1e6
    assert c.norm_eps == pytest.approx(1e-6)
    assert c.qkv_bias and not c.qk_norm and not c.post_norms and not c.tied_embeddings
    assert c.activation == "silu" and c.embed_scale == 1.0 and not c.rope_interleaved
    assert c.sliding_window is None and not any(c.is_sliding(i) for i in range(3))
    assert c.attn_scale == pytest.approx(16 ** -0.5)
    assert c.final_logit_softcap is None and c.attn_logit_softcap is None and c.rope_scaling is None


def test_llama_config(tiny_model_path):
    c = load_gguf(tiny_model_path("llama")).config
    assert c.arch == "llama" and not c.qkv_bias and c.rope_interleaved and c.rope_base == 500000.0
    assert c.norm_eps == pytest.approx(1e-5) and not c.tied_embeddings


def test_qwen3_config(tiny_model_path):
    """Qwen3: QK-norm over each head (attn_q_norm / attn_k_norm), no qkv biases, NeoX rope,
    heads wider than embedding_length / head_count (attention.key_length)."""
    c = load_gguf(tiny_model_path("qwen3", head_dim=32)).config
    assert c.arch == "qwen3" and c.qk_norm and not c.qkv_bias and not c.post_norms
    assert c.head_dim == 32 and c.n_heads * c.head_dim != c.hidden and not c.rope_interleaved
    assert not c.fused_qkv and not c.fused_gate_up and c.activation == "silu"


def test_qwen3_without_its_qk_norms_is_refused(tiny_model_path):
    path = tiny_model_path("qwen3", omit=["blk.1.attn_k_norm.weight"])
    with pytest.raises(ModelError, match=r"has no tensor 'blk\.1\.attn_k_norm\.weight' \(needed by its qwen3"):
        load_gguf(path)


def test_llama3_rope_factors_are_read(tiny_model_path):
    rope = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context_length=64)
    gf = load_gguf(tiny_model_path("llama", tied=True, llama3_rope=rope))
    factors = gf.tensor("rope_freqs.weight")
    assert factors.shape == (gf.config.head_dim // 2,) and gf.config.tied_embeddings


def test_phi3_config(tiny_model_path):
    """Phi-3: q/k/v in one attn_qkv matrix and gate/up in one ffn_up; its sliding window is
    ignored, as llama.cpp ignores it."""
    gf = load_gguf(tiny_model_path("phi3", hidden=64, n_heads=4, n_kv_heads=4, head_dim=16, ffn=96))
    c = gf.config
    assert c.arch == "phi3" and c.fused_qkv and c.fused_gate_up and not c.qkv_bias and not c.qk_norm
    assert c.sliding_window is None and not c.rope_interleaved
    assert gf.tensor("blk.0.attn_qkv.weight").shape == (3 * 64, 64)
    assert gf.tensor("blk.0.ffn_up.weight").shape == (2 * 96, 64)


def test_phi3_longrope_is_refused_in_one_line(tiny_model_path):
    path = tiny_model_path("phi3", n_kv_heads=4, extra={"rope_factors_long.weight": np.ones(8, np.float32),
                                                        "rope_factors_short.weight": np.ones(8, np.float32)})
    with pytest.raises(ModelError, match=r"uses LongRoPE .*; use a 4k-context Phi-3 GGUF") as e:
        load_gguf(path)
    assert "\n" not in str(e.value)


def test_gemma3_config(tiny_model_path):
    c = load_gguf(tiny_model_path("gemma3", n_layers=12, hidden=64, n_heads=2, n_kv_heads=1,
                                  head_dim=48, sliding_window=16)).config
    assert c.head_dim == 48 and c.n_heads * c.head_dim != c.hidden
    assert c.qk_norm and c.post_norms and c.tied_embeddings and not c.qkv_bias
    assert c.activation == "gelu_tanh" and c.embed_scale == pytest.approx(math.sqrt(64))
    assert c.rope_base == 1e6 and c.rope_local_base == 10000.0
    assert c.sliding_window == 16
    assert [i for i in range(12) if not c.is_sliding(i)] == [5, 11]
    assert c.attn_scale == pytest.approx(48 ** -0.5)


def test_gemma3_softcaps_rope_scaling_and_explicit_pattern(tiny_model_path):
    c = load_gguf(tiny_model_path("gemma3", n_layers=4, metadata={
        "gemma3.final_logit_softcapping": 30.0,
        "gemma3.attention.sliding_window_pattern": [True, False, True, False],
        "gemma3.rope.scaling.type": "linear",
        "gemma3.rope.scaling.factor": 8.0,
        "gemma3.attention.scale": 0.125,
    })).config
    assert c.final_logit_softcap == 30.0 and c.attn_logit_softcap is None
    assert [c.is_sliding(i) for i in range(4)] == [True, False, True, False]
    assert c.rope_scaling == {"type": "linear", "factor": 8.0}
    assert c.attn_scale == 0.125


def test_tensor_lookup(tiny_model_path):
    gf = load_gguf(tiny_model_path("qwen2"))
    assert gf.tensor("blk.1.ffn_up.weight").shape == (128, 64)
    assert gf.has("output.weight") and not gf.has("blk.9.attn_q.weight")
    with pytest.raises(ModelError, match=r"has no tensor 'blk\.3\.attn_q\.weight'"):
        gf.tensor("blk.3.attn_q.weight")


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        load_gguf(tmp_path / "nope.gguf")
    with pytest.raises(ModelError, match=r"is not a regular file \(it is a directory\)"):
        load_gguf(tmp_path)


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04zipfile", b"<html>not found</html>"])
def test_not_a_gguf_file(tmp_path, content):
    p = tmp_path / "model.gguf"
    p.write_bytes(content)
    with pytest.raises(ModelError, match="is not a GGUF file"):
        load_gguf(p)


def test_truncated_file(tiny_model_path, tmp_path):
    data = tiny_model_path("qwen2").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])          # tensor data cut short
    with pytest.raises(ModelError, match=r"truncated or corrupt: tensor 'output\.weight' needs bytes"):
        load_gguf(cut)
    cut.write_bytes(data[:2000])          # header cut short (inside the vocabulary)
    with pytest.raises(ModelError, match="truncated or corrupt"):
        load_gguf(cut)


def test_unknown_architecture(tmp_path):
    p = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(p), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match="architecture 'mamba' is not supported; supported "
                                         "architectures are qwen2, qwen3, llama, gemma3, phi3"):
        load_gguf(p)


def test_missing_metadata_key(tiny_model_path):
    with pytest.raises(ModelError, match="'qwen2.block_count' is missing"):
        load_gguf(tiny_model_path("qwen2", omit=["qwen2.block_count"]))


def test_missing_tensor_fails_at_load(tiny_model_path):
    with pytest.raises(ModelError, match=r"has no tensor 'blk\.1\.ffn_up\.weight'"):
        load_gguf(tiny_model_path("qwen2", omit=["blk.1.ffn_up.weight"]))
    with pytest.raises(ModelError, match=r"has no tensor 'blk\.0\.attn_q_norm\.weight' and 1 more"):
        load_gguf(tiny_model_path("gemma3", n_layers=2, omit=["blk.0.attn_q_norm.weight",
                                                              "blk.1.attn_q_norm.weight"]))


def test_metadata_that_contradicts_tensor_shapes(tiny_model_path):
    with pytest.raises(ModelError, match=r"'blk\.0\.attn_q\.weight' has shape \(64, 64\) but the "
                                         r"metadata implies \(128, 64\)"):
        load_gguf(tiny_model_path("qwen2", metadata={"qwen2.attention.head_count": 8,
                                                     "qwen2.attention.key_length": 16}))


@pytest.mark.realmodel
def test_real_qwen_config(real_model_path):
    gf = load_gguf(real_model_path)
    c = gf.config
    assert (c.arch, c.n_layers, c.hidden, c.ffn_dim, c.n_heads, c.n_kv_heads, c.head_dim) == \
        ("qwen2", 24, 896, 4864, 14, 2, 64)
    assert c.vocab_size == 151936 and c.rope_base == 1e6 and c.qkv_bias and not c.tied_embeddings
    assert c.metadata["tokenizer.ggml.eos_token_id"] == 151645
    assert len(c.metadata["tokenizer.ggml.merges"]) == 151387
    types = {td.ggml_type.name for td in gf.tensors.values()}
    assert types == {"Q5_0", "F32", "Q8_0", "Q6_K", "Q4_K"}


@pytest.mark.realmodel
def test_real_gemma_config(real_gemma_path):
    gf = load_gguf(real_gemma_path)
    c = gf.config
    assert (c.arch, c.n_layers, c.hidden, c.ffn_dim, c.n_heads, c.n_kv_heads, c.head_dim) == \
        ("gemma3", 18, 640, 2048, 4, 1, 256)
    assert c.sliding_window == 512 and [i for i in range(18) if not c.is_sliding(i)] == [5, 11, 17]
    assert c.tied_embeddings and c.qk_norm and c.post_norms and c.vocab_size == 262144
    assert c.attn_scale == 1 / 16 and c.rope_local_base == 10000.0 and c.final_logit_softcap is None


# ---- corrupt files: each field checked before it is used, the whole table before the first step

@pytest.fixture(scope="module")
def probe():
    """Loads in a child with a deadline and bounded memory (a hang fails, it does not hang)."""
    with LoadProbe() as p:
        yield p


@pytest.mark.parametrize("kind, owner, value, which", [
    ("tensor_count", "", 2**64 - 1, 0),
    ("kv_count", "", 2**64 - 1, 0),
    ("key_length", "general.name", 2**64 - 1, 0),
    ("string_length", "general.name", 2**63, 0),
    ("string_length", "tokenizer.ggml.tokens", 2**40, 7),        # one vocabulary entry
    ("array_length", "tokenizer.ggml.tokens", 2**32 - 1, 0),     # the vocabulary size
    ("array_length", "tokenizer.ggml.token_type", 2**62, 0),
    ("n_dims", "blk.1.ffn_up.weight", 2**32 - 1, 0),
    ("dim", "token_embd.weight", 2**63, 1),
    ("value", "qwen2.block_count", 2**32 - 1, 0),                 # grew to 6.2 GB in 30 s
    ("value", "qwen2.attention.head_count", 2**32 - 1, 0),
    ("value", "qwen2.attention.head_count_kv", 2**32 - 1, 0),
])
def test_a_huge_count_is_refused_before_anything_is_allocated(tiny_model_path, probe, kind, owner, value, which):
    path = corrupted(tiny_model_path("qwen2"), kind, owner, value, which)
    result = probe.load(path)
    assert result["outcome"] == "refused", result
    assert acceptable(result, path) is None, result
    assert result["seconds"] < 1.0 and result["rss_growth"] < 64 << 20, result


@pytest.mark.realmodel
@pytest.mark.parametrize("kind, owner", [("n_dims", "blk.0.attn_q.weight"), ("value", "qwen2.block_count")])
def test_a_huge_count_in_the_real_header_is_refused_at_once(real_model_path, tmp_path, probe, kind, owner):
    """n_dims = 2^32-1 took 20 s and 3.9 GB, block_count = 2^32-1 never finished. The real
    header and a hole of the real file's length (the loader reads no tensor bytes)."""
    with open(real_model_path, "rb") as f:
        head = f.read(16 << 20)
    fields = header_fields(head)
    path = tmp_path / "real-corrupt.gguf"
    with open(path, "wb") as f:
        f.write(fields.find(kind, owner).patch(head[:fields.end], 2**32 - 1))
        f.truncate(real_model_path.stat().st_size)
    result = probe.load(path)
    assert result["outcome"] == "refused" and acceptable(result, path) is None, result
    assert result["seconds"] < 2.0 and result["rss_growth"] < 256 << 20, result


def test_a_lowered_block_count_is_refused_not_run(tiny_model_path):
    """block_count 1 on a 2-layer file ran the first layer only, silently."""
    path = corrupted(tiny_model_path("qwen2", n_layers=2), "value", "qwen2.block_count", 1)
    with pytest.raises(ModelError, match=r"has tensor 'blk\.1\.attn_norm\.weight' and 11 more, which a 1-layer "
                                         r"qwen2 model \(qwen2\.block_count = 1\) does not have"):
        load_gguf(path)


def test_a_raised_block_count_is_refused(tiny_model_path):
    path = corrupted(tiny_model_path("qwen2", n_layers=2), "value", "qwen2.block_count", 3)
    with pytest.raises(ModelError, match=r"has no tensor 'blk\.2\.attn_norm\.weight' and 11 more"):
        load_gguf(path)


def test_a_tensor_the_architecture_does_not_have_is_refused(tiny_model_path):
    """An output-projection bias (a variant the decoder does not compute) was ignored."""
    path = tiny_model_path("qwen2", extra={"blk.0.attn_output.bias": np.zeros(64, np.float32)})
    with pytest.raises(ModelError, match=r"has tensor 'blk\.0\.attn_output\.bias', which a 2-layer qwen2 model "
                                         r".* does not have: its metadata and its tensors disagree"):
        load_gguf(path)


def test_a_shape_error_in_a_later_layer_is_refused_at_load(tiny_model_path):
    """Only blk.0's shapes were checked: blk.1.ffn_up stored as (64, 128) instead of
    (128, 64), the same bytes, loaded and failed at the first step."""
    path = tiny_model_path("qwen2", n_layers=2, hidden=64, ffn=128)
    data = path.read_bytes()
    fields = header_fields(data)
    dims = [fields.find("dim", "blk.1.ffn_up.weight", i) for i in (0, 1)]
    swapped = dims[1].patch(dims[0].patch(data, dims[1].read(data)), dims[0].read(data))
    path.write_bytes(swapped)
    with pytest.raises(ModelError, match=r"tensor 'blk\.1\.ffn_up\.weight' has shape \(64, 128\) but the "
                                         r"metadata implies \(128, 64\)"):
        load_gguf(path)


@pytest.mark.parametrize("name, new_type", [("blk.0.attn_v.weight", T.Q4_0),     # Q8_0: fewer bytes
                                            ("blk.1.ffn_gate.weight", T.F32),    # BF16: more bytes
                                            ("blk.0.attn_norm.weight", T.F16)])  # F32: half the bytes
def test_a_retyped_tensor_is_named_at_load(tiny_model_path, name, new_type):
    """A wrong ggml type in the table was read as that type and blamed on "this CPU's
    kernel" by the self-check; the tensor no longer fills its place in the file."""
    path = corrupted(tiny_model_path("qwen2", n_layers=2), "type", name, int(new_type))
    with pytest.raises(ModelError, match=rf"is corrupt: tensor '{name}' \({new_type.name}, shape .* takes .* "
                                         rf"so the next tensor, .* should start at .*: the type or shape of"):
        load_gguf(path)


def test_a_type_without_kernel_or_fallback_is_refused_at_load(tiny_model_path):
    path = tiny_model_path("llama", hidden=256, ffn=512, head_dim=64, types={"ffn_down": T.IQ2_XXS})
    with pytest.raises(ModelError, match=r"tensor 'blk\.0\.ffn_down\.weight' is stored as IQ2_XXS, which "
                                         r"tokentop cannot compute \(supported: .*IQ4_XS\); use a GGUF "
                                         r"quantized to one of those types$"):
        load_gguf(path)


def test_an_unsupported_type_is_refused_at_load(tiny_model_path):
    path = tiny_model_path("qwen2", types=T.F32)
    path = corrupted(path, "type", "blk.0.attn_q.weight", int(T.I32))   # the same 4 bytes a value
    with pytest.raises(ModelError, match=r"tensor 'blk\.0\.attn_q\.weight' is stored as I32, which tokentop "
                                         r"cannot compute \(supported: F32, F16"):
        load_gguf(path)


@pytest.mark.parametrize("metadata, omit, fragment", [
    # each was a bare exception (the type name and a Python message) or loaded silently
    ({"qwen2.attention.head_count": 0}, (), "qwen2.attention.head_count is 0"),               # ZeroDivisionError
    ({"qwen2.attention.key_length": 0}, (), "qwen2.attention.key_length is 0"),               # ZeroDivisionError
    ({"qwen2.block_count": math.inf}, ["qwen2.block_count"], "qwen2.block_count is inf"),     # OverflowError
    ({"qwen2.block_count": "two"}, ["qwen2.block_count"], "qwen2.block_count is 'two'"),     # ValueError
    ({"qwen2.rope.freq_base": "fast"}, ["qwen2.rope.freq_base"], "rope.freq_base is 'fast'"),  # ValueError
    ({"qwen2.attention.layer_norm_rms_epsilon": math.nan}, (), "layer_norm_rms_epsilon is nan"),
    ({"qwen2.context_length": 0}, (), "qwen2.context_length is 0"),                          # hung at a step
    ({"qwen2.rope.scaling.type": "linear", "qwen2.rope.scaling.factor": 0.0}, (), "rope.scaling.factor is 0.0"),
    ({"qwen2.attention.scale": -1.0}, (), "qwen2.attention.scale is -1.0"),
    ({"qwen2.attention.head_count": [4, 4, 4]}, ["qwen2.attention.head_count"], "or 2 of them (one a layer)"),
    ({"qwen2.attention.head_count_kv": 3}, (), "head_count_kv is 3, but it must be a divisor of the head count"),
    ({"qwen2.rope.dimension_count": 8}, (), "rope.dimension_count is 8, but it must be the head size 16"),
    ({"tokenizer.ggml.tokens": tiny_vocab()[0][:-1]}, (), "the vocabulary (tokenizer.ggml.tokens) has 263 "
                                                          "entries but token_embd.weight has 264 rows"),
])
def test_a_bad_metadata_value_is_one_line_naming_file_and_key(tiny_model_path, metadata, omit, fragment):
    path = tiny_model_path("qwen2", n_layers=2, metadata=metadata, omit=omit)
    with pytest.raises(ModelError) as err:
        load_gguf(path)
    message = str(err.value)
    assert fragment in message and str(path) in message and "\n" not in message, message


@pytest.mark.parametrize("metadata, fragment", [
    ({"gemma3.attention.sliding_window_pattern": 0}, "sliding_window_pattern is 0"),   # ZeroDivisionError
    ({"gemma3.attention.sliding_window_pattern": [True, False]}, "one true/false for each of the 6 layers"),
    ({"gemma3.attention.sliding_window": 0}, "sliding_window is 0"),
    ({"gemma3.final_logit_softcapping": 0.0}, "final_logit_softcapping is 0.0"),
])
def test_a_bad_gemma3_value_is_one_line(tiny_model_path, metadata, fragment):
    path = tiny_model_path("gemma3", n_layers=6, metadata=metadata)
    with pytest.raises(ModelError, match=re.escape(fragment)):
        load_gguf(path)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_model_path_that_is_not_a_regular_file(tmp_path):
    with pytest.raises(ModelError, match=r"^/dev/zero is not a regular file \(it is a character device\)"):
        load_gguf("/dev/zero")
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ModelError, match=r"is not a regular file \(it is a named pipe\)"):
        load_gguf(fifo)        # opened without blocking: no writer ever comes

