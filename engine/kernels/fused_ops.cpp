// The per-layer work around the quantized matmuls, one C++ op per stretch of elementwise code:
// as ~40 small torch ops per layer, a decode step spent much of its time in dispatch and
// temporaries (docs/kernels.md, 'Framework overhead: fused per-layer ops').
// Reference semantics: engine/models/fused.py (the torch fallback).
//   add_rms_norm     x += delta (optional), return rms_norm(x) * w
//   act_mul          act(gate) * up for a [T, 2F] gate|up row (silu or gelu-tanh)
//   rope_store_kv    optional QK-norm, rotary on q and k, q scaled, K/V written to their slots
//   decode_attention one query row per sequence over its paged keys (softmax(q k^T) v)
//   greedy_pick      argmax of each logits row and its logprob, in two passes over the row
//                    (greedy_row, with the vector helpers, in vec_math.h)
// Every row is computed on its own, in a fixed order: results never depend on the batch.
// Hot loops are plain C++ cloned per ISA (GCC target_clones picks one at load time), written so
// the compiler vectorizes them without reassociating sums (16 independent accumulators).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ops.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int ACC = 16;   // independent partial sums: one AVX-512 register of lanes

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

inline float bits_to_float(uint32_t b) {
    float f;
    std::memcpy(&f, &b, sizeof f);
    return f;
}

// 16-bit K/V reads, exact and branch-free so that the attention loops vectorize (c10's
// conversions do not, and made decode over a 16-bit store far slower than over fp32:
// docs/kernels.md, 'KV dtype').
template <>
inline float to_f<c10::BFloat16>(c10::BFloat16 v) { return bits_to_float(uint32_t(v.x) << 16); }

// fp16: exponent and mantissa moved into fp32's places and rebiased by 2^112 (exact for normal
// and subnormal values alike); Inf/NaN get fp32's all-ones exponent; then the sign
template <>
inline float to_f<c10::Half>(c10::Half v) {
    const uint32_t h = v.x, em = h & 0x7FFFu;
    const float mag = em >= 0x7C00u ? bits_to_float(0x7F800000u | ((em & 0x3FFu) << 13))
                                    : bits_to_float(em << 13) * 0x1p112f;
    return (h & 0x8000u) ? -mag : mag;
}

// the ACC partial sums added as a tree (a few shuffles, not a chain of 16 dependent adds)
inline float reduce(float* acc) {
    for (int w = ACC / 2; w > 0; w /= 2)
        for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
    return acc[0];
}

// dot and axpy are inlined into their (cloned) callers, so each clone gets its own vector width
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
    float acc[ACC] = {};
    int64_t i = 0;
    for (; i + ACC <= n; i += ACC)
        for (int j = 0; j < ACC; ++j) acc[j] += a[i + j] * to_f(b[i + j]);
    float s = 0.0f;
    for (; i < n; ++i) s += a[i] * to_f(b[i]);
    return s + reduce(acc);
}

// fp32 rows (the default KV store): vec_math.h's dot_f32 (16 lanes in two 8-lane halves)
template <>
inline float dot<float>(const float* a, const float* b, int64_t n) { return dot_f32(a, b, n); }

template <typename T>
inline void axpy(float w, const T* x, float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] += w * to_f(x[i]);
}

// A K/V row as fp32: 16-bit rows converted once into buf (then read by every head of the group),
// fp32 rows used in place
template <typename S>
inline const float* as_f32(const S* row, float* buf, int64_t n) {
    if constexpr (std::is_same_v<S, float>) {
        return row;
    } else {
        for (int64_t i = 0; i < n; ++i) buf[i] = to_f(row[i]);
        return buf;
    }
}

// s[i] = exp(s[i] - mx); returns the sum (in ACC partial sums, then in order)
TT_INLINE float exp_shifted(float* s, int64_t n, float mx) {
    for (int64_t i = 0; i < n; ++i) s[i] = exp_approx(s[i] - mx);
    float acc[ACC] = {};
    int64_t i = 0;
    for (; i + ACC <= n; i += ACC)
        for (int j = 0; j < ACC; ++j) acc[j] += s[i + j];
    float sum = 0.0f;
    for (; i < n; ++i) sum += s[i];
    return sum + reduce(acc);
}

// out = x * rsqrt(mean(x^2) + eps) * w
inline void rms_norm_row(const float* x, const float* w, float eps, float* out, int64_t n) {
    const float inv = 1.0f / std::sqrt(dot(x, x, n) / float(n) + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// x += d (when given), out = rms_norm(x) * w
TT_CLONES void add_rms_norm_row(float* x, const float* d, const float* w, float eps, float* out, int64_t n) {
    if (d)
        for (int64_t i = 0; i < n; ++i) x[i] += d[i];
    rms_norm_row(x, w, eps, out, n);
}

// silu(g) * u and gelu_tanh(g) * u, a vector at a time (16 values on AVX-512, 8 elsewhere:
// TT_BY_WIDTH), then the tail: left to the auto-vectorizer, the silu loop got a second division
// and three blends per vector and ran several times slower on AVX2 (docs/kernels.md, 'Vector
// width per instruction set'). Each value goes through the same operations either way, so the
// bits are the same.
template <typename F>
TT_INLINE void silu_mul_row_w(const float* g, const float* u, float* out, int64_t n) {
    constexpr int W = sizeof(F) / sizeof(float);
    int64_t i = 0;
    for (; i + W <= n; i += W) {
        const F x = load_lanes<F>(g + i);
        store_lanes(out + i, F(x / (1.0f + exp_approxv(-x)) * load_lanes<F>(u + i)));
    }
    for (; i < n; ++i) out[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
}
TT_BY_WIDTH(silu_mul_row, (const float* g, const float* u, float* out, int64_t n), (g, u, out, n))

// gelu with the tanh approximation; tanh(y) = 1 - 2 / (exp(2y) + 1)
TT_INLINE float exp_of(float x) { return exp_approx(x); }
template <typename F>
TT_INLINE F exp_of(F x) { return exp_approxv(x); }

template <typename F>
TT_INLINE F gelu_tanh(F x) {
    const F y = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    const F t = 1.0f - 2.0f / (exp_of(2.0f * y) + 1.0f);
    return 0.5f * x * (1.0f + t);
}

template <typename F>
TT_INLINE void gelu_tanh_mul_row_w(const float* g, const float* u, float* out, int64_t n) {
    constexpr int W = sizeof(F) / sizeof(float);
    int64_t i = 0;
    for (; i + W <= n; i += W)
        store_lanes(out + i, F(gelu_tanh(load_lanes<F>(g + i)) * load_lanes<F>(u + i)));
    for (; i < n; ++i) out[i] = gelu_tanh(g[i]) * u[i];
}
TT_BY_WIDTH(gelu_tanh_mul_row, (const float* g, const float* u, float* out, int64_t n), (g, u, out, n))

// Rows of a [T, ...] op: one thread for a decode row (waking the pool costs more than the row).
template <typename F>
void for_rows(int64_t T, int64_t grain, const F& f) {
    if (T <= grain) {
        f(0, T);
    } else {
        at::parallel_for(0, T, grain, f);
    }
}

void check_f32(const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
                name, " must be a contiguous fp32 CPU tensor");
}

at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& delta, const at::Tensor& w,
                        double eps) {
    check_f32(x, "x");
    check_f32(w, "w");
    TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1), "x [T, n], w [n]");
    const int64_t T = x.size(0), n = x.size(1);
    if (delta) {
        check_f32(*delta, "delta");
        TORCH_CHECK(delta->sizes() == x.sizes(), "delta must have x's shape");
    }
    at::Tensor out = at::empty({T, n}, x.options());
    float* xp = x.data_ptr<float>();
    const float* dp = delta ? delta->data_ptr<float>() : nullptr;
    const float* wp = w.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for_rows(T, 16, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
            add_rms_norm_row(xp + t * n, dp ? dp + t * n : nullptr, wp, float(eps), op + t * n, n);
        }
    });
    return out;
}

at::Tensor act_mul(const at::Tensor& gate_up, int64_t act) {
    check_f32(gate_up, "gate_up");
    TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up [T, 2F]");
    TORCH_CHECK(act == 0 || act == 1, "act: 0 silu, 1 gelu-tanh");
    const int64_t T = gate_up.size(0), F = gate_up.size(1) / 2;
    at::Tensor out = at::empty({T, F}, gate_up.options());
    const float* g = gate_up.data_ptr<float>();
    float* o = out.data_ptr<float>();
    const int level = simd_level();
    const auto row = act == 0 ? silu_mul_row_for(level) : gelu_tanh_mul_row_for(level);
    for_rows(T, 4, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
            const float* gt = g + t * 2 * F;
            row(gt, gt + F, o + t * F, F);
        }
    });
    return out;
}

// out = x * c + swap(x) * s, swap pairing dims (i, i + hd/2) (NeoX) or (2i, 2i+1) (interleaved);
// the sign of rotate-half lives in the signed-sin table, as in engine/models/rope.py
// (NeoX as two plain loops, which vectorize: a per-element choice of the partner did not)
inline void rotate(const float* x, const float* c, const float* s, bool interleaved, int64_t hd,
                   float* out) {
    const int64_t half = hd / 2;
    if (interleaved) {
        for (int64_t i = 0; i < hd; ++i) out[i] = x[i] * c[i] + x[i ^ 1] * s[i];
        return;
    }
    for (int64_t i = 0; i < half; ++i) out[i] = x[i] * c[i] + x[i + half] * s[i];
    for (int64_t i = half; i < hd; ++i) out[i] = x[i] * c[i] + x[i - half] * s[i];
}

template <typename S>
void store_row(const float* src, S* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<S>(src[i]);
}

template <typename S>
void rope_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
               const float* qk_norm, float eps, float q_scale, int64_t H, int64_t KV, bool interleaved,
               at::Tensor& k_store, at::Tensor& v_store, const int64_t* slots, at::Tensor& q) {
    const int64_t T = qkv.size(0), hd = cos.size(1), width = qkv.size(1);
    const float* src = qkv.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    S* ks = k_store.data_ptr<S>();
    S* vs = v_store.data_ptr<S>();
    float* qp = q.data_ptr<float>();
    for_rows(T, 8, [&](int64_t b, int64_t e) {
        std::vector<float> normed(hd), cq(hd), sq(hd), rot(hd);
        for (int64_t t = b; t < e; ++t) {
            const float* row = src + t * width;
            const float* c = cp + t * hd;
            const float* s = sp + t * hd;
            for (int64_t i = 0; i < hd; ++i) {   // q's tables carry the attention scale
                cq[i] = c[i] * q_scale;
                sq[i] = s[i] * q_scale;
            }
            for (int64_t h = 0; h < H + KV; ++h) {
                const float* x = row + h * hd;
                if (qk_norm) {
                    rms_norm_row(x, qk_norm + h * hd, eps, normed.data(), hd);
                    x = normed.data();
                }
                if (h < H) {
                    rotate(x, cq.data(), sq.data(), interleaved, hd, qp + (t * H + h) * hd);
                } else {
                    rotate(x, c, s, interleaved, hd, rot.data());
                    store_row(rot.data(), ks + (slots[t] * KV + (h - H)) * hd, hd);
                }
            }
            store_row(row + (H + KV) * hd, vs + slots[t] * KV * hd, KV * hd);
        }
    });
}

void check_store(const at::Tensor& s, const char* name) {
    TORCH_CHECK(s.device().is_cpu() && s.is_contiguous() && s.dim() == 3, name,
                " must be a contiguous [slots, kv_heads, head_dim] CPU tensor");
}

void check_slots(const at::Tensor& slots, int64_t num_slots) {
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots must be contiguous int64");
    const int64_t* p = slots.data_ptr<int64_t>();
    for (int64_t i = 0; i < slots.numel(); ++i)
        TORCH_CHECK(p[i] >= 0 && p[i] < num_slots, "KV slot ", p[i], " out of range [0, ", num_slots, ")");
}

at::Tensor rope_store_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         const c10::optional<at::Tensor>& qk_norm, double eps, double q_scale,
                         int64_t n_heads, int64_t n_kv, bool interleaved, at::Tensor k_store,
                         at::Tensor v_store, const at::Tensor& slots) {
    check_f32(qkv, "qkv");
    check_f32(cos, "cos");
    check_f32(sin, "sin");
    check_store(k_store, "k_store");
    check_store(v_store, "v_store");
    const int64_t T = qkv.size(0), hd = cos.size(1);
    TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (n_heads + 2 * n_kv) * hd, "qkv [T, (H + 2 KV) hd]");
    TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == T && hd % 2 == 0, "cos/sin [T, hd]");
    TORCH_CHECK(k_store.size(1) == n_kv && k_store.size(2) == hd && v_store.sizes() == k_store.sizes() &&
                v_store.scalar_type() == k_store.scalar_type(), "K/V stores [slots, KV, hd]");
    TORCH_CHECK(slots.numel() == T, "one slot per row");
    check_slots(slots, k_store.size(0));
    const float* qn = nullptr;
    if (qk_norm) {
        check_f32(*qk_norm, "qk_norm");
        TORCH_CHECK(qk_norm->numel() == (n_heads + n_kv) * hd, "qk_norm [H + KV, hd]");
        qn = qk_norm->data_ptr<float>();
    }
    at::Tensor q = at::empty({T, n_heads, hd}, qkv.options());
    const int64_t* sl = slots.data_ptr<int64_t>();
    const float e = float(eps), sc = float(q_scale);
    switch (k_store.scalar_type()) {
        case at::kFloat:
            rope_rows<float>(qkv, cos, sin, qn, e, sc, n_heads, n_kv, interleaved, k_store, v_store, sl, q);
            break;
        case at::kBFloat16:
            rope_rows<c10::BFloat16>(qkv, cos, sin, qn, e, sc, n_heads, n_kv, interleaved, k_store, v_store, sl, q);
            break;
        case at::kHalf:
            rope_rows<c10::Half>(qkv, cos, sin, qn, e, sc, n_heads, n_kv, interleaved, k_store, v_store, sl, q);
            break;
        default:
            TORCH_CHECK(false, "K/V store dtype must be fp32, bf16 or fp16");
    }
    return q;
}

// Each of the G rows of scores [G, L]: softcapped (softcap > 0), then exp(s - max); inv[g] gets
// 1 / the row's sum (the outputs are scaled by it at the end)
TT_INLINE void softmax_unnormalized(float* scores, int64_t L, int64_t G, float softcap, float* inv) {
    for (int64_t g = 0; g < G; ++g) {
        float* sg = scores + g * L;
        if (softcap > 0.0f)
            for (int64_t j = 0; j < L; ++j) sg[j] = std::tanh(sg[j] / softcap) * softcap;
        float mx = sg[0];
        for (int64_t j = 1; j < L; ++j) mx = sg[j] > mx ? sg[j] : mx;
        inv[g] = 1.0f / exp_shifted(sg, L, mx);
    }
}

// One query head group (G heads sharing a KV head) of one sequence over its L keys; each key
// and value row is read once for all G heads. scores: [G, L] scratch.
// HD > 0: the head size as a constant (the dot and axpy loops unroll fully; same operations in
// the same order as the runtime size, so the results are identical)
template <typename S, int HD>
TT_CLONES void attend_group(const float* q, const S* k, const S* v, int64_t row_stride, const int64_t* slots,
                            int64_t L, int64_t G, int64_t hd_, float softcap, float* scores, float* out) {
    const int64_t hd = HD > 0 ? HD : hd_;
    std::vector<float> row(std::is_same_v<S, float> ? 0 : hd);
    for (int64_t j = 0; j < L; ++j) {
        const float* kj = as_f32(k + slots[j] * row_stride, row.data(), hd);
        for (int64_t g = 0; g < G; ++g) scores[g * L + j] = dot(q + g * hd, kj, hd);
    }
    std::vector<float> inv(G);
    softmax_unnormalized(scores, L, G, softcap, inv.data());
    std::fill(out, out + G * hd, 0.0f);
    for (int64_t j = 0; j < L; ++j) {
        const float* vj = as_f32(v + slots[j] * row_stride, row.data(), hd);
        for (int64_t g = 0; g < G; ++g) axpy(scores[g * L + j], vj, out + g * hd, hd);
    }
    for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < hd; ++i) out[g * hd + i] *= inv[g];
}

// --- the blocked decode attention --------------------------------------------------------
// Vectors of W floats: W = 16 in the AVX-512 build of the kernel, 8 (one ymm register) in the
// AVX2 one. GCC splits a 16-float vector into two ymm registers on AVX2, and the AVX-512 block
// sizes then spilled to memory, slower than the plain loops there (docs/kernels.md, 'Vector
// width per instruction set').
template <int W> struct Vec;
template <> struct Vec<16> {
    typedef v16 F;
    typedef uint16_t H __attribute__((vector_size(32), aligned(2)));
    typedef uint32_t U __attribute__((vector_size(64)));
};
template <> struct Vec<8> {
    typedef v8 F;
    typedef uint16_t H __attribute__((vector_size(16), aligned(2)));
    typedef uint32_t U __attribute__((vector_size(32)));
};

// W K/V values from the store as fp32, exact for every type: the bit arithmetic of to_f on whole
// vectors (a per-value loop did not vectorize here: fp16 took 2x an fp32 read)
template <int W, typename S>
TT_INLINE typename Vec<W>::F loadv(const S* p) {
    using F = typename Vec<W>::F;
    using U = typename Vec<W>::U;
    if constexpr (std::is_same_v<S, float>) {
        return *(const F*)p;
    } else {
        const U h = __builtin_convertvector(*(const typename Vec<W>::H*)p, U);
        if constexpr (std::is_same_v<S, c10::BFloat16>) {
            return (F)(h << 16);
        } else {
            const U em = h & 0x7FFFu;
            const U finite = (U)((F)(em << 13) * 0x1p112f);
            const U special = 0x7F800000u | ((em & 0x3FFu) << 13);
            return (F)((em >= 0x7C00u ? special : finite) | ((h & 0x8000u) << 16));
        }
    }
}


// Rows PF keys ahead are prefetched: the K/V of a decode step comes from memory (the weights
// streamed through the caches since this layer last ran), and without it the loads of a row
// waited behind its arithmetic instead of overlapping it.
constexpr int64_t PF = 16;

template <typename S>
TT_INLINE void prefetch_row(const S* row, int64_t n) {
    for (int64_t b = 0; b < n * int64_t(sizeof(S)); b += 64) __builtin_prefetch((const char*)row + b, 0, 3);
}

// Lane n of the result is hsum(v[n]), bit for bit: the same pairs of lanes at each level (i and
// i + W/2 first, as hsum), 3W - 3 shuffles and adds for W sums where hsum takes ~W for one.
TT_INLINE v16 hsum_lanes(const v16* v) {
    v16 c[8], e[4], g[2];
    for (int k = 0; k < 8; ++k)          // lanes i, i + 8: vectors 2k | 2k + 1, 8 lanes each
        c[k] = __builtin_shufflevector(v[2 * k], v[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[2 * k], v[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int m = 0; m < 4; ++m)          // lanes i, i + 4: vectors 4m .. 4m + 3, 4 lanes each
        e[m] = __builtin_shufflevector(c[2 * m], c[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(c[2 * m], c[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int p = 0; p < 2; ++p)          // lanes 0, 2 and 1, 3: vectors 8p .. 8p + 7, 2 lanes each
        g[p] = __builtin_shufflevector(e[2 * p], e[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(e[2 * p], e[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(g[0], g[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(g[0], g[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
TT_INLINE v8 hsum_lanes(const v8* v) {
    v8 c[4], g[2];
    for (int k = 0; k < 4; ++k)          // lanes i, i + 4: vectors 2k | 2k + 1, 4 lanes each
        c[k] = __builtin_shufflevector(v[2 * k], v[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(v[2 * k], v[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int p = 0; p < 2; ++p)          // lanes 0, 2 and 1, 3: vectors 4p .. 4p + 3, 2 lanes each
        g[p] = __builtin_shufflevector(c[2 * p], c[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(c[2 * p], c[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(g[0], g[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(g[0], g[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

// attend_group for a head size HD and group size G known at compile time, W-float vectors and
// REGS vector registers. The one-row-at-a-time loops above were bound by the latency of each
// 128-long dot product and its reduction: here fp32 keys are dotted W at a time with one head
// (W independent vector sums in registers, reduced together by hsum_lanes: one hsum per score
// took as many operations as its dot), 16-bit ones KB at a time with all G heads, and values are summed CB W-wide slices at a time with the G
// heads' sums in registers instead of read and written back in memory per key. Each score and
// output is summed in the same order as there (results agree to an ulp or so); each row on its
// own, so still batch-invariant to the bit.
template <typename S, int HD, int G, int W, int REGS>
TT_INLINE void attend_blocked(const float* q, const S* k, const S* v, int64_t row_stride, const int64_t* slots,
                           int64_t L, float softcap, float* scores, float* out) {
    using F = typename Vec<W>::F;
    constexpr int C = HD / W;
    // G * CB sums + CB value slices, CB a power of two dividing C
    constexpr int CB = (G + 1) * 8 <= REGS && C % 8 == 0 ? 8 : (G + 1) * 4 <= REGS && C % 4 == 0 ? 4
                     : (G + 1) * 2 <= REGS && C % 2 == 0 ? 2 : 1;
    int64_t j = 0;
    if constexpr (std::is_same_v<S, float>) {
        // W keys at a time, one head after the other: the W scores of a head come out of one
        // hsum_lanes, and the keys' rows are read again per head from L1
        for (; j + W <= L; j += W) {
            const S* rows[W];
            for (int b = 0; b < W; ++b) rows[b] = k + slots[j + b] * row_stride;
            for (int64_t p = j + PF; p < std::min(j + PF + W, L); ++p) prefetch_row(k + slots[p] * row_stride, HD);
            for (int g = 0; g < G; ++g) {
                F acc[W] = {};
                for (int c = 0; c < C; ++c) {
                    const F qg = *(const F*)(q + g * HD + c * W);
                    for (int b = 0; b < W; ++b) acc[b] += qg * loadv<W>(rows[b] + c * W);
                }
                *(F*)(scores + g * L + j) = hsum_lanes(acc);
            }
        }
    } else {
        // 16-bit rows are converted once per key for all G heads (per head, their conversions
        // cost more than the reductions saved: fp16 1.6-2x slower, bf16 1.2-1.5x): KB keys with
        // all G heads at once, KB * G sums + KB keys + one q slice in registers
        constexpr int KB = (REGS - 1) / (G + 1) > 4 ? 4 : (REGS - 1) / (G + 1) < 1 ? 1 : (REGS - 1) / (G + 1);
        for (; j + KB <= L; j += KB) {
            F acc[KB][G] = {};
            const S* rows[KB];
            for (int b = 0; b < KB; ++b) rows[b] = k + slots[j + b] * row_stride;
            for (int64_t p = j + PF; p < std::min(j + PF + KB, L); ++p) prefetch_row(k + slots[p] * row_stride, HD);
            for (int c = 0; c < C; ++c) {
                F kv[KB];
                for (int b = 0; b < KB; ++b) kv[b] = loadv<W>(rows[b] + c * W);
                for (int g = 0; g < G; ++g) {
                    const F qg = *(const F*)(q + g * HD + c * W);
                    for (int b = 0; b < KB; ++b) acc[b][g] += qg * kv[b];
                }
            }
            for (int b = 0; b < KB; ++b)
                for (int g = 0; g < G; ++g) scores[g * L + j + b] = hsum(acc[b][g]);
        }
    }
    for (; j < L; ++j) {
        F acc[G] = {};
        const S* row = k + slots[j] * row_stride;
        for (int c = 0; c < C; ++c) {
            const F kv = loadv<W>(row + c * W);
            for (int g = 0; g < G; ++g) acc[g] += *(const F*)(q + g * HD + c * W) * kv;
        }
        for (int g = 0; g < G; ++g) scores[g * L + j] = hsum(acc[g]);
    }
    float inv[G];
    softmax_unnormalized(scores, L, G, softcap, inv);
    for (int c0 = 0; c0 < C; c0 += CB) {
        F acc[G][CB] = {};
        for (int64_t i = 0; i < L; ++i) {
            if (i + PF < L) prefetch_row(v + slots[i + PF] * row_stride + c0 * W, CB * W);
            const S* row = v + slots[i] * row_stride + c0 * W;
            F vv[CB];
            for (int c = 0; c < CB; ++c) vv[c] = loadv<W>(row + c * W);
            for (int g = 0; g < G; ++g) {
                const float p = scores[g * L + i];
                for (int c = 0; c < CB; ++c) acc[g][c] += p * vv[c];
            }
        }
        for (int g = 0; g < G; ++g)
            for (int c = 0; c < CB; ++c) {
                const F o = acc[g][c];
                for (int e = 0; e < W; ++e) out[g * HD + (c0 + c) * W + e] = o[e] * inv[g];
            }
    }
}

using AttendFn = void (*)(const float*, const void*, const void*, int64_t, const int64_t*, int64_t,
                          float, float*, float*);

// one build per instruction set (not target_clones: the block sizes depend on the vector width)
#if defined(__GNUC__) && defined(__x86_64__)
template <typename S, int HD, int G>
__attribute__((target("avx512f,avx2,fma"))) void attend_avx512(
        const float* q, const void* k, const void* v, int64_t row_stride, const int64_t* slots, int64_t L,
        float softcap, float* scores, float* out) {
    attend_blocked<S, HD, G, 16, 32>(q, static_cast<const S*>(k), static_cast<const S*>(v), row_stride, slots, L,
                                     softcap, scores, out);
}

template <typename S, int HD, int G>
__attribute__((target("avx2,fma"))) void attend_avx2(
        const float* q, const void* k, const void* v, int64_t row_stride, const int64_t* slots, int64_t L,
        float softcap, float* scores, float* out) {
    attend_blocked<S, HD, G, 8, 16>(q, static_cast<const S*>(k), static_cast<const S*>(v), row_stride, slots, L,
                                    softcap, scores, out);
}

template <typename S, int HD, int G>
AttendFn blocked_isa() {
    switch (simd_level()) {   // 0: the runtime-size loops
        case 2: return &attend_avx512<S, HD, G>;
        case 1: return &attend_avx2<S, HD, G>;
        default: return nullptr;
    }
}
#else
template <typename S, int HD, int G>
AttendFn blocked_isa() { return nullptr; }
#endif

template <typename S, int HD>
AttendFn blocked_for_group(int64_t G) {
    switch (G) {
        case 1: return blocked_isa<S, HD, 1>();
        case 2: return blocked_isa<S, HD, 2>();
        case 4: return blocked_isa<S, HD, 4>();
        case 6: return blocked_isa<S, HD, 6>();
        case 7: return blocked_isa<S, HD, 7>();
        case 8: return blocked_isa<S, HD, 8>();
        default: return nullptr;
    }
}

// The blocked kernel for this CPU, head size and group size, or null (the runtime-size loops)
template <typename S>
AttendFn blocked_for(int64_t hd, int64_t G) {
    return hd == 64 ? blocked_for_group<S, 64>(G) : hd == 128 ? blocked_for_group<S, 128>(G) : nullptr;
}

template <typename S>
void attend_rows(const at::Tensor& q, const at::Tensor& k_store, const at::Tensor& v_store,
                 const at::Tensor& slots, const at::Tensor& lengths, float softcap, at::Tensor& out) {
    const int64_t B = q.size(0), H = q.size(1), hd = q.size(2), KV = k_store.size(1), G = H / KV;
    const int64_t Lmax = slots.size(1), row_stride = KV * hd;
    const float* qp = q.data_ptr<float>();
    const S* kp = k_store.data_ptr<S>();
    const S* vp = v_store.data_ptr<S>();
    const int64_t* sl = slots.data_ptr<int64_t>();
    const int64_t* len = lengths.data_ptr<int64_t>();
    float* op = out.data_ptr<float>();
    const AttendFn blocked = blocked_for<S>(hd, G);
    // one task per (sequence, KV head): each reads its keys once for its G query heads
    at::parallel_for(0, B * KV, 1, [&](int64_t b0, int64_t e0) {
        std::vector<float> scores(G * Lmax);
        for (int64_t i = b0; i < e0; ++i) {
            const int64_t b = i / KV, h = i % KV;
            if (blocked) {
                blocked(qp + (b * H + h * G) * hd, kp + h * hd, vp + h * hd, row_stride, sl + b * Lmax, len[b],
                        softcap, scores.data(), op + (b * H + h * G) * hd);
                continue;
            }
            auto* f = hd == 64 ? &attend_group<S, 64> : hd == 128 ? &attend_group<S, 128> : &attend_group<S, 0>;
            f(qp + (b * H + h * G) * hd, kp + h * hd, vp + h * hd, row_stride, sl + b * Lmax,
              len[b], G, hd, softcap, scores.data(), op + (b * H + h * G) * hd);
        }
    });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_store, const at::Tensor& v_store,
                            const at::Tensor& slots, const at::Tensor& lengths, double softcap) {
    check_f32(q, "q");
    check_store(k_store, "k_store");
    check_store(v_store, "v_store");
    TORCH_CHECK(q.dim() == 3 && q.size(2) == k_store.size(2) && q.size(1) % k_store.size(1) == 0,
                "q [B, H, hd] with H a multiple of the KV heads");
    TORCH_CHECK(v_store.sizes() == k_store.sizes() && v_store.scalar_type() == k_store.scalar_type(),
                "K and V stores must match");
    TORCH_CHECK(slots.dim() == 2 && slots.size(0) == q.size(0), "slots [B, Lmax]");
    TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.numel() == q.size(0) && lengths.is_contiguous(),
                "lengths: int64 [B]");
    check_slots(slots, k_store.size(0));
    const int64_t* len = lengths.data_ptr<int64_t>();
    for (int64_t b = 0; b < q.size(0); ++b)
        TORCH_CHECK(len[b] >= 1 && len[b] <= slots.size(1), "length ", len[b], " outside [1, Lmax]");
    at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
    const float cap = float(softcap);
    switch (k_store.scalar_type()) {
        case at::kFloat: attend_rows<float>(q, k_store, v_store, slots, lengths, cap, out); break;
        case at::kBFloat16: attend_rows<c10::BFloat16>(q, k_store, v_store, slots, lengths, cap, out); break;
        case at::kHalf: attend_rows<c10::Half>(q, k_store, v_store, slots, lengths, cap, out); break;
        default: TORCH_CHECK(false, "K/V store dtype must be fp32, bf16 or fp16");
    }
    return out;
}

// Greedy choice of each row (the lowest id among equal maxima), its logprob (NaN unless
// `logprobs`) and whether the row is usable (no NaN, a finite max).
std::tuple<at::Tensor, at::Tensor, at::Tensor> greedy_pick(const at::Tensor& logits, bool logprobs) {
    check_f32(logits, "logits");
    TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits [R, V]");
    const int64_t R = logits.size(0), V = logits.size(1);
    at::Tensor ids = at::empty({R}, logits.options().dtype(at::kLong));
    at::Tensor lp = at::empty({R}, logits.options());
    at::Tensor ok = at::empty({R}, logits.options().dtype(at::kBool));
    const float* x = logits.data_ptr<float>();
    int64_t* ip = ids.data_ptr<int64_t>();
    float* lpp = lp.data_ptr<float>();
    bool* okp = ok.data_ptr<bool>();
    // rows spread over the threads; each row is computed alone, so its result does not depend on
    // the batch or the split
    const auto row = greedy_row_for(simd_level());
    for_rows(R, 1, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) row(x + r * V, V, logprobs, ip + r, lpp + r, okp + r);
    });
    return {ids, lp, ok};
}

}  // namespace

namespace tt::ops {

at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& delta, const at::Tensor& w, double eps) {
    return ::add_rms_norm(std::move(x), delta, w, eps);
}
at::Tensor act_mul(const at::Tensor& gate_up, int64_t act) { return ::act_mul(gate_up, act); }
at::Tensor rope_store_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         const c10::optional<at::Tensor>& qk_norm, double eps, double q_scale, int64_t n_heads,
                         int64_t n_kv, bool interleaved, at::Tensor k_store, at::Tensor v_store,
                         const at::Tensor& slots) {
    return ::rope_store_kv(qkv, cos, sin, qk_norm, eps, q_scale, n_heads, n_kv, interleaved, std::move(k_store),
                           std::move(v_store), slots);
}
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_store, const at::Tensor& v_store,
                            const at::Tensor& slots, const at::Tensor& lengths, double softcap) {
    return ::decode_attention(q, k_store, v_store, slots, lengths, softcap);
}

}  // namespace tt::ops

TORCH_LIBRARY_FRAGMENT(tokentop, m) {
    m.def("add_rms_norm(Tensor(a!) x, Tensor? delta, Tensor w, float eps) -> Tensor");
    m.def("act_mul(Tensor gate_up, int act) -> Tensor");
    m.def("rope_store_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor? qk_norm, float eps, float q_scale, "
          "int n_heads, int n_kv, bool interleaved, Tensor(a!) k_store, Tensor(b!) v_store, "
          "Tensor slots) -> Tensor");
    m.def("decode_attention(Tensor q, Tensor k_store, Tensor v_store, Tensor slots, Tensor lengths, "
          "float softcap) -> Tensor");
    m.def("greedy_pick(Tensor logits, bool logprobs=True) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tokentop, CPU, m) {
    m.impl("add_rms_norm", &add_rms_norm);
    m.impl("act_mul", &act_mul);
    m.impl("rope_store_kv", &rope_store_kv);
    m.impl("decode_attention", &decode_attention);
    m.impl("greedy_pick", &greedy_pick);
}
