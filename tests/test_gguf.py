"""GGUF loading: config from metadata, zero-copy tensors, and clear errors for broken files."""
from __future__ import annotations

import math

import gguf
import numpy as np
import pytest

from engine.errors import ModelError
from engine.models.gguf import SUPPORTED_ARCHS, load_gguf


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
    with pytest.raises(ModelError, match="not a file"):
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
                                         "architectures are qwen2, llama, gemma3"):
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
