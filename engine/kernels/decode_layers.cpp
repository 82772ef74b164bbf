// tokentop.DecodeLayers: every decoder layer of a decode step in one call from Python.
//
// Block.forward (engine/models/decoder.py) makes ten op calls a layer: a 1.5B decode step made
// ~300 calls from Python, time spent between the kernels (docs/kernels.md, 'One call per
// decode step, one weight row at a time'). This class holds each layer's weights as the ops take
// them and runs the same sequence of the same ops (ops.h: the functions the ops register, so the
// bits are the same) without going back to Python. It serves steps where every row is a decode
// row attended by the fused op; the decoder takes the per-layer path for the rest (prefill,
// dense weight forms, NVTX ranges). At full trace detail it also writes clock readings around
// each part of a layer (`marks`), from which the tracer records the per-layer scopes.
#include <time.h>

#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "ops.h"

namespace {

// Clock readings per layer in `marks`, in this order (engine/models/decoder.py MARKS reads them)
enum Mark { LAYER, QKV, QKV_END, ATTENTION, ATTENTION_END, O_END, ATTN_END, GATE_UP, GATE_UP_END, DOWN,
            DOWN_END, MLP_END, LAYER_END, N_MARKS };

// CLOCK_MONOTONIC in ns: what Python's time.perf_counter_ns reads, so the marks line up with
// the tracer's other events
inline int64_t now_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// One linear layer: GGUF matrices stacked along the output dimension (QuantLinear's GGUFWeight)
struct Linear {
    std::vector<at::Tensor> weights;
    std::vector<int64_t> types, rows;
    std::optional<at::Tensor> bias;
    int64_t small_m = -1;   // 0 in deterministic mode: one kernel for every row count

    at::Tensor operator()(const at::Tensor& x) const {
        return tt::ops::qmatmul(x, weights, types, rows, bias, -1, small_m, -1);
    }
};

struct Layer {
    at::Tensor attn_norm, ffn_norm;
    std::optional<at::Tensor> qk_norm, post_attn_norm, post_ffn_norm;   // gemma's
    bool sliding = false;           // attends over the sliding window's plan and rotary table
    std::vector<Linear> linears;    // qkv, o, gate|up, down
};

class DecodeLayers : public torch::CustomClassHolder {
public:
    DecodeLayers(int64_t n_heads, int64_t n_kv, double eps, double attn_scale, double softcap, int64_t act,
                 bool interleaved)
        : n_heads_(n_heads), n_kv_(n_kv), eps_(eps), attn_scale_(attn_scale), softcap_(softcap), act_(act),
          interleaved_(interleaved) {}

    void add_layer(at::Tensor attn_norm, at::Tensor ffn_norm, std::optional<at::Tensor> qk_norm,
                   std::optional<at::Tensor> post_attn_norm, std::optional<at::Tensor> post_ffn_norm, bool sliding) {
        layers_.push_back({std::move(attn_norm), std::move(ffn_norm), std::move(qk_norm), std::move(post_attn_norm),
                           std::move(post_ffn_norm), sliding, {}});
    }

    // the last added layer's next linear layer, in the order qkv, o, gate|up, down
    void add_linear(std::vector<at::Tensor> weights, std::vector<int64_t> types, std::vector<int64_t> rows,
                    std::optional<at::Tensor> bias, int64_t small_m) {
        TORCH_CHECK(!layers_.empty() && layers_.back().linears.size() < 4, "add_linear: add a layer first");
        layers_.back().linears.push_back({std::move(weights), std::move(types), std::move(rows), std::move(bias),
                                          small_m});
    }

    // x [B, hidden]: one decode row per sequence, updated in place and returned. Each plan is
    // [cos, sin, key slots, key counts] for one attention kind (rope.lookup of the rows'
    // positions, DecodeGroup.slots/lengths); `local` is empty when no layer slides. `marks`, when
    // given: int64 [layers, N_MARKS], filled with the clock readings of enum Mark.
    at::Tensor run(at::Tensor x, std::vector<at::Tensor> k_stores, std::vector<at::Tensor> v_stores,
                   at::Tensor write_slots, std::vector<at::Tensor> global, std::vector<at::Tensor> local,
                   std::optional<at::Tensor> marks) {
        TORCH_CHECK(k_stores.size() == layers_.size() && v_stores.size() == layers_.size(),
                    "run: one K and one V store per layer");
        TORCH_CHECK(global.size() == 4 && (local.empty() || local.size() == 4),
                    "run: a plan is [cos, sin, slots, lengths]");
        int64_t* t = nullptr;
        if (marks) {
            TORCH_CHECK(marks->scalar_type() == at::kLong && marks->is_contiguous() && marks->device().is_cpu() &&
                            marks->numel() == int64_t(layers_.size()) * N_MARKS,
                        "run: marks must be a contiguous int64 CPU tensor [layers, ", int(N_MARKS), "]");
            t = marks->data_ptr<int64_t>();
        }
        // one clock reading when marking (a few ns), none otherwise
        auto mark = [&t](Mark m) { if (t) t[m] = now_ns(); };
        for (size_t i = 0; i < layers_.size(); ++i) {
            const Layer& L = layers_[i];
            TORCH_CHECK(L.linears.size() == 4, "run: layer ", i, " has ", L.linears.size(), " linear layers, not 4");
            TORCH_CHECK(!L.sliding || !local.empty(), "run: layer ", i, " slides but no local plan was given");
            const std::vector<at::Tensor>& p = L.sliding ? local : global;
            mark(LAYER);
            at::Tensor normed = tt::ops::add_rms_norm(x, std::nullopt, L.attn_norm, eps_);
            mark(QKV);
            at::Tensor qkv = L.linears[0](normed);
            mark(QKV_END);
            at::Tensor q = tt::ops::rope_store_kv(qkv, p[0], p[1], L.qk_norm, eps_, attn_scale_, n_heads_, n_kv_,
                                                  interleaved_, k_stores[i], v_stores[i], write_slots);
            mark(ATTENTION);
            at::Tensor attended = tt::ops::decode_attention(q, k_stores[i], v_stores[i], p[2], p[3], softcap_);
            mark(ATTENTION_END);
            at::Tensor a = L.linears[1](attended);
            mark(O_END);
            if (L.post_attn_norm) a = tt::ops::add_rms_norm(a, std::nullopt, *L.post_attn_norm, eps_);
            mark(ATTN_END);
            // x += a, then the MLP's norm
            at::Tensor h = tt::ops::add_rms_norm(x, a, L.ffn_norm, eps_);
            mark(GATE_UP);
            at::Tensor gate_up = L.linears[2](h);
            mark(GATE_UP_END);
            at::Tensor act = tt::ops::act_mul(gate_up, act_);
            mark(DOWN);
            at::Tensor m = L.linears[3](act);
            mark(DOWN_END);
            if (L.post_ffn_norm) m = tt::ops::add_rms_norm(m, std::nullopt, *L.post_ffn_norm, eps_);
            mark(MLP_END);
            x.add_(m);
            mark(LAYER_END);
            if (t) t += N_MARKS;
        }
        return x;
    }

private:
    int64_t n_heads_, n_kv_;
    double eps_, attn_scale_, softcap_;
    int64_t act_;
    bool interleaved_;
    std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokentop, m) {
    m.class_<DecodeLayers>("DecodeLayers")
        .def(torch::init<int64_t, int64_t, double, double, double, int64_t, bool>())
        .def("add_layer", &DecodeLayers::add_layer)
        .def("add_linear", &DecodeLayers::add_linear)
        .def("run", &DecodeLayers::run);
}
