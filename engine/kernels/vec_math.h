// Vector math shared by fused_ops.cpp, top_candidates.cpp and tools/fused_vector_width.cpp
// (which times the 8- and 16-lane forms): no torch here, so the tool builds with plain g++. Hot
// loops are GCC vector types in functions built per ISA (target_clones, or TT_BY_WIDTH where the
// vector width differs by ISA); helpers are always inlined into their callers' builds.
// Everything has internal linkage: each includer gets its own copy.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define TT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
// lets the clamps and selects become vector blends (the includers raise no FP traps)
#pragma GCC optimize("no-trapping-math")
#else
#define TT_CLONES
#endif

// for helpers, inlined into each ISA's build of their caller (the blocked decode attention's,
// called out of line, ran as baseline x86-64 code with vectors through memory)
#define TT_INLINE inline __attribute__((always_inline))

namespace {

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));

// 2^n * p(r) with n = round(x / ln2), |r| <= ln2/2, p the Cephes expf polynomial (~2 ulp);
// written branch-free so that a loop over it vectorizes (std::exp does not). exp_parts is the
// part shared by the float and the 8-lane (exp_approx8) forms: x clamped, n and p(r).
template <typename F>
TT_INLINE F exp_parts(F x, F& n) {
    x = x < -87.0f ? -87.0f + F{} : x;
    x = x > 88.0f ? 88.0f + F{} : x;
    // round to nearest by adding and removing 1.5 * 2^23 (no libm call, vectorizes)
    n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const F r = x - n * 0.693359375f + n * 2.12194440e-4f;
    F p = 1.9875691500e-4f + F{};
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return p * r * r + r + 1.0f;
}

TT_INLINE float exp_approx(float x) {
    float n;
    const float p = exp_parts(x, n);
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

typedef int32_t vi8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));
template <int BYTES> struct IntLanes;   // the int32 vector as wide as a float vector
template <> struct IntLanes<32> { typedef vi8 T; };
template <> struct IntLanes<64> { typedef vi16 T; };

// exp_approx on a vector of 8 or 16 lanes: the same operations per lane, so the same bits
template <typename F>
TT_INLINE F exp_approxv(F x) {
    F n;
    const F p = exp_parts(x, n);
    using I = typename IntLanes<sizeof(F)>::T;
    const I bits = (__builtin_convertvector(n, I) + 127) << 23;
    return p * (F)bits;   // a vector cast keeps the bits
}

// The vector build to run: 2 AVX-512, 1 AVX2 with FMA, 0 neither. TOKENTOP_KERNEL_ISA=scalar|avx2
// caps it as it caps the quantized matmuls (read per call, so a test can run each build).
inline int simd_level() {
#if defined(__GNUC__) && defined(__x86_64__)
    static const int best = __builtin_cpu_supports("avx512f") ? 2
                          : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
#else
    static const int best = 0;
#endif
    const char* s = std::getenv("TOKENTOP_KERNEL_ISA");
    const int want = !s ? best : std::strcmp(s, "scalar") == 0 ? 0 : std::strcmp(s, "avx2") == 0 ? 1 : best;
    return std::min(want, best);
}

// A function in two vector widths: name##_w<v16> in an AVX-512 build, name##_w<v8> in an AVX2
// one and a baseline one; name##_for(simd_level()) gives the build to run, looked up once per op
// call, not per row. GCC lowers a 16-float vector's compares, selects and int conversions through
// memory on AVX2 (a 151936-logit exp-sum 4x slower there), while on AVX-512 the 8-lane form runs
// at a third of the 16-lane one's speed (tools/fused_vector_width.cpp; docs/kernels.md, 'Vector
// width per instruction set'). Within a build each value goes through the same operations in
// either width (the AVX-512 build fuses multiply-adds, as the avx512f clone of target_clones does).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define TT_BY_WIDTH(name, params, args)                                                    \
    __attribute__((target("avx512f"))) void name##_avx512 params { name##_w<v16> args; }    \
    __attribute__((target("avx2"))) void name##_avx2 params { name##_w<v8> args; }          \
    void name##_baseline params { name##_w<v8> args; }                                     \
    inline auto name##_for(int level) {                                                    \
        return level == 2 ? &name##_avx512 : level == 1 ? &name##_avx2 : &name##_baseline;  \
    }
#else
#define TT_BY_WIDTH(name, params, args)                                                    \
    void name##_baseline params { name##_w<v8> args; }                                     \
    inline auto name##_for(int) { return &name##_baseline; }
#endif

// Unaligned vector loads and stores for a vector type passed as a template argument, which
// loses the typedef's aligned(4) (a plain dereference would assume full alignment)
template <typename F>
TT_INLINE F load_lanes(const float* p) {
    F v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}
template <typename F>
TT_INLINE void store_lanes(float* p, F v) { __builtin_memcpy(p, &v, sizeof v); }

// a vector's lanes added as a tree (halving shuffles)
TT_INLINE float hsum(v8 h) {
    const v4 h4 = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}
TT_INLINE float hsum(v16 a) {
    return hsum(v8(__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15)));
}

// Dot product of two fp32 rows: the sums of one 16-lane accumulator, kept as two 8-lane halves
// (a 16-float vector goes through memory on AVX2, tools/fused_vector_width.cpp), reduced by halving
// shuffles, then the tail in order
TT_INLINE float dot_f32(const float* a, const float* b, int64_t n) {
    v8 lo = {}, hi = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        lo += *(const v8*)(a + i) * *(const v8*)(b + i);
        hi += *(const v8*)(a + i + 8) * *(const v8*)(b + i + 8);
    }
    float s = hsum(v8(lo + hi));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

// the largest lane (halving shuffles; NaN lanes never win a comparison)
TT_INLINE float hmax(v8 h) {
    const v4 l4 = __builtin_shufflevector(h, h, 0, 1, 2, 3), h4 = __builtin_shufflevector(h, h, 4, 5, 6, 7);
    const v4 q = h4 > l4 ? h4 : l4;
    const float m0 = q[0] > q[2] ? q[0] : q[2], m1 = q[1] > q[3] ? q[1] : q[3];
    return m1 > m0 ? m1 : m0;
}

TT_INLINE float hmax(v16 a) {
    const v8 lo = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7);
    const v8 hi = __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    return hmax(hi > lo ? hi : lo);
}

// The max of x[b0, b1): four chains of F vectors, then the tail (NaN lanes never win a
// comparison, and the max of the rest does not depend on the order). Inlined into each build
// of its caller, as every helper here.
template <typename F>
TT_INLINE float max_of(const float* x, int64_t b0, int64_t b1) {
    constexpr int W = sizeof(F) / sizeof(float);
    const float ninf = -std::numeric_limits<float>::infinity();
    F m0 = ninf + F{}, m1 = m0, m2 = m0, m3 = m0;
    int64_t i = b0;
    for (; i + 4 * W <= b1; i += 4 * W) {
        const F a = load_lanes<F>(x + i), b = load_lanes<F>(x + i + W);
        const F c = load_lanes<F>(x + i + 2 * W), d = load_lanes<F>(x + i + 3 * W);
        m0 = a > m0 ? a : m0;
        m1 = b > m1 ? b : m1;
        m2 = c > m2 ? c : m2;
        m3 = d > m3 ? d : m3;
    }
    m0 = m1 > m0 ? m1 : m0;
    m2 = m3 > m2 ? m3 : m2;
    float m = hmax(m2 > m0 ? m2 : m0);
    for (; i < b1; ++i) m = x[i] > m ? x[i] : m;
    return m;
}

// Whether x[0, n) holds a NaN (a vector compare a step, the lanes ORed at the end)
template <typename F>
TT_INLINE bool any_nan(const float* x, int64_t n) {
    constexpr int W = sizeof(F) / sizeof(float);
    typename IntLanes<sizeof(F)>::T bad = {};
    int64_t i = 0;
    for (; i + W <= n; i += W) {
        const F v = load_lanes<F>(x + i);
        bad |= v != v;
    }
    int32_t any = 0;
    for (int l = 0; l < W; ++l) any |= bad[l];
    for (; i < n; ++i) any |= x[i] != x[i];
    return any != 0;
}

// Max and exp-sum of one row of logits, in chunks of CHUNK values: pass 1 reduces the lanes' max
// once per chunk and notes the first chunk that holds the row's max, where the first index of
// the max is then searched; pass 2 sums exp(x - max) in 16 lanes across a chunk (one 16-float
// vector or two 8-float ones, the same sums: hsum adds a v16's halves first) and adds each
// chunk's sum to a double. (Reduced every 64 values in 16-lane vectors, the row took a visible
// share of an 8-row decode step on AVX2: docs/kernels.md.) A NaN logit makes the exp-sum NaN
// (exp_approx and the additions carry it), so the row is flagged from it. Without want_logprob
// the exp-sum is skipped (the logprob is NaN) and a compare pass looks for NaN instead.
template <typename F>
TT_INLINE void greedy_row_w(const float* x, int64_t V, bool want_logprob, int64_t* id, float* logprob, bool* ok) {
    constexpr int64_t CHUNK = 1024;   // 64 values a lane a chunk
    constexpr int W = sizeof(F) / sizeof(float), PARTS = 16 / W;
    float best = -std::numeric_limits<float>::infinity();
    int64_t best_chunk = 0;
    for (int64_t c0 = 0; c0 < V; c0 += CHUNK) {
        const float m = max_of<F>(x, c0, std::min(V, c0 + CHUNK));
        if (m > best) {                    // strictly greater: the first chunk with the max wins
            best = m;
            best_chunk = c0;
        }
    }
    int64_t i = best_chunk;
    while (i + 1 < V && x[i] != best) ++i;   // found in this chunk unless the row is all NaN
    *id = i;
    if (!want_logprob) {   // the exp-sum costs 4x the max: only for a client that reads it
        *ok = std::isfinite(best) && !any_nan<F>(x, V);
        *logprob = std::numeric_limits<float>::quiet_NaN();
        return;
    }
    double sum = 0.0;
    for (int64_t c0 = 0; c0 < V; c0 += CHUNK) {
        const int64_t c1 = std::min(V, c0 + CHUNK);
        F acc[PARTS] = {};
        int64_t j = c0;
        for (; j + 16 <= c1; j += 16)
            for (int p = 0; p < PARTS; ++p) acc[p] += exp_approxv(load_lanes<F>(x + j + p * W) - best);
        float s;
        if constexpr (PARTS == 1) s = hsum(acc[0]);
        else s = hsum(v8(acc[0] + acc[1]));
        for (; j < c1; ++j) s += exp_approx(x[j] - best);
        sum += s;
    }
    *ok = std::isfinite(best) && !std::isnan(sum);
    *logprob = float(-std::log(sum));   // the chosen token's logit is the max: x - max = 0
}
TT_BY_WIDTH(greedy_row, (const float* x, int64_t V, bool want_logprob, int64_t* id, float* logprob, bool* ok),
            (x, V, want_logprob, id, logprob, ok))

}  // namespace
