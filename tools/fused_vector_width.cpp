// Why engine/kernels/fused_ops.cpp writes its generic-vector loops with 8-float vectors: the same
// loop over 16-float vectors (GCC vector extensions, target_clones) against two 8-float halves,
// in the clone this CPU runs. On AVX2, GCC lowers a 16-float vector's compares, selects and int
// conversions through memory. One thread; medians of 7 runs.
//   g++ -O3 -std=c++17 -Wno-psabi tools/fused_vector_width.cpp -o /tmp/fvw && /tmp/fvw
// Prints ms per call for: the exp-sum of a 151936-logit row (greedy_pick's second pass), the
// greedy_pick row as it was (16 lanes, reduced every 64 logits) and as it is, and a 896-long dot
// product (rms_norm's sum of squares).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define INL inline __attribute__((always_inline))
#pragma GCC optimize("no-trapping-math")

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));
typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi8 __attribute__((vector_size(32), aligned(4)));

// fused_ops.cpp's exp_parts and exp_approx (the Cephes expf polynomial)
template <typename F>
INL F exp_parts(F x, F& n) {
    x = x < -87.0f ? -87.0f + F{} : x;
    x = x > 88.0f ? 88.0f + F{} : x;
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
template <typename F, typename I>
INL F exp_v(F x) {
    F n;
    const F p = exp_parts(x, n);
    const I bits = (__builtin_convertvector(n, I) + 127) << 23;
    return p * reinterpret_cast<const F&>(bits);
}
INL float exp1(float x) {
    float n;
    const float p = exp_parts(x, n);
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float s;
    __builtin_memcpy(&s, &bits, 4);
    return p * s;
}
INL float hsum8(v8 h) {
    const v4 h4 = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}
INL float hsum16(v16 a) {
    return hsum8(v8(__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15)));
}
INL float hmax8(v8 h) {
    const v4 l4 = __builtin_shufflevector(h, h, 0, 1, 2, 3), h4 = __builtin_shufflevector(h, h, 4, 5, 6, 7);
    const v4 q = h4 > l4 ? h4 : l4;
    const float m0 = q[0] > q[2] ? q[0] : q[2], m1 = q[1] > q[3] ? q[1] : q[3];
    return m1 > m0 ? m1 : m0;
}
INL float hmax16(v16 a) {
    const v8 lo = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7);
    const v8 hi = __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    return hmax8(hi > lo ? hi : lo);
}

CLONES float exp_sum16(const float* x, int64_t n, float mx) {
    v16 acc = {};
    for (int64_t j = 0; j + 16 <= n; j += 16) acc += exp_v<v16, vi16>(*(const v16*)(x + j) - mx);
    return hsum16(acc);
}
CLONES float exp_sum8(const float* x, int64_t n, float mx) {
    v8 a = {}, b = {};
    for (int64_t j = 0; j + 16 <= n; j += 16) {
        a += exp_v<v8, vi8>(*(const v8*)(x + j) - mx);
        b += exp_v<v8, vi8>(*(const v8*)(x + j + 8) - mx);
    }
    return hsum8(v8(a + b));
}

// greedy_pick's row before this change: max and exp-sum per 64 logits, each block reduced at once
CLONES float greedy_row_before(const float* x, int64_t V, int64_t* id) {
    const float ninf = -std::numeric_limits<float>::infinity();
    float best = ninf;
    int64_t best_block = 0;
    for (int64_t b0 = 0; b0 + 64 <= V; b0 += 64) {
        v16 mv = ninf + v16{};
        for (int64_t i = 0; i < 64; i += 16) {
            const v16 v = *(const v16*)(x + b0 + i);
            mv = v > mv ? v : mv;
        }
        const float m = hmax16(mv);
        if (m > best) best = m, best_block = b0;
    }
    int64_t i = best_block;
    while (i + 1 < V && x[i] != best) ++i;
    double sum = 0.0;
    int64_t j = 0;
    for (; j + 64 <= V; j += 64) {
        v16 acc = {};
        for (int64_t t = 0; t < 64; t += 16) acc += exp_v<v16, vi16>(*(const v16*)(x + j + t) - best);
        float a[16];
        for (int k = 0; k < 16; ++k) a[k] = acc[k];
        for (int w = 8; w > 0; w /= 2)
            for (int k = 0; k < w; ++k) a[k] += a[k + w];
        sum += a[0];
    }
    for (; j < V; ++j) sum += exp1(x[j] - best);
    *id = i;
    return float(-std::log(sum));
}

// as it is now (fused_ops.cpp's greedy_row: 8-lane vectors, reduced once per 1024 logits)
CLONES float greedy_row_now(const float* x, int64_t V, int64_t* id) {
    const float ninf = -std::numeric_limits<float>::infinity();
    float best = ninf;
    int64_t best_chunk = 0;
    for (int64_t c0 = 0; c0 < V; c0 += 1024) {
        const int64_t c1 = std::min(V, c0 + 1024);
        v8 m0 = ninf + v8{}, m1 = m0, m2 = m0, m3 = m0;
        int64_t i = c0;
        for (; i + 32 <= c1; i += 32) {
            const v8 a = *(const v8*)(x + i), b = *(const v8*)(x + i + 8);
            const v8 c = *(const v8*)(x + i + 16), d = *(const v8*)(x + i + 24);
            m0 = a > m0 ? a : m0;
            m1 = b > m1 ? b : m1;
            m2 = c > m2 ? c : m2;
            m3 = d > m3 ? d : m3;
        }
        m0 = m1 > m0 ? m1 : m0;
        m2 = m3 > m2 ? m3 : m2;
        float m = hmax8(m2 > m0 ? m2 : m0);
        for (; i < c1; ++i) m = x[i] > m ? x[i] : m;
        if (m > best) best = m, best_chunk = c0;
    }
    int64_t i = best_chunk;
    while (i + 1 < V && x[i] != best) ++i;
    double sum = 0.0;
    for (int64_t c0 = 0; c0 < V; c0 += 1024) {
        const int64_t c1 = std::min(V, c0 + 1024);
        float s = exp_sum8(x + c0, (c1 - c0) / 16 * 16, best);
        for (int64_t j = c0 + (c1 - c0) / 16 * 16; j < c1; ++j) s += exp1(x[j] - best);
        sum += s;
    }
    *id = i;
    return float(-std::log(sum));
}

CLONES float dot16(const float* a, const float* b, int64_t n) {
    v16 acc = {};
    for (int64_t i = 0; i + 16 <= n; i += 16) acc += *(const v16*)(a + i) * *(const v16*)(b + i);
    return hsum16(acc);
}
CLONES float dot8x2(const float* a, const float* b, int64_t n) {
    v8 lo = {}, hi = {};
    for (int64_t i = 0; i + 16 <= n; i += 16) {
        lo += *(const v8*)(a + i) * *(const v8*)(b + i);
        hi += *(const v8*)(a + i + 8) * *(const v8*)(b + i + 8);
    }
    return hsum8(v8(lo + hi));
}

template <class F>
static double median_ms(F f, int reps) {
    std::vector<double> t;
    for (int r = 0; r < 7; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < reps; ++i) f();
        t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / reps);
    }
    std::sort(t.begin(), t.end());
    return t[3];
}

int main() {
    const int64_t V = 151936, D = 896;
    std::vector<float> x(V);
    std::mt19937 g(1);
    std::normal_distribution<float> nd(0.0f, 4.0f);
    for (float& v : x) v = nd(g);
    volatile float sink;
    int64_t id_before = 0, id_now = 0;
    const float lp_before = greedy_row_before(x.data(), V, &id_before), lp_now = greedy_row_now(x.data(), V, &id_now);
    printf("greedy row: id %ld / %ld, logprob %.7f / %.7f (before / now)\n", long(id_before), long(id_now),
           lp_before, lp_now);
    printf("exp-sum of %ld logits: 16 lanes %.4f ms, 8 lanes x2 %.4f ms\n", long(V),
           median_ms([&] { sink = exp_sum16(x.data(), V, 20.0f); }, 300),
           median_ms([&] { sink = exp_sum8(x.data(), V, 20.0f); }, 300));
    int64_t id;
    printf("greedy row: before %.4f ms, now %.4f ms\n", median_ms([&] { sink = greedy_row_before(x.data(), V, &id); }, 300),
           median_ms([&] { sink = greedy_row_now(x.data(), V, &id); }, 300));
    printf("dot of %ld: 16 lanes %.5f ms, 8 lanes x2 %.5f ms (same sums: %s)\n", long(D),
           median_ms([&] { sink = dot16(x.data(), x.data() + D, D); }, 20000),
           median_ms([&] { sink = dot8x2(x.data(), x.data() + D, D); }, 20000),
           dot16(x.data(), x.data() + D, D) == dot8x2(x.data(), x.data() + D, D) ? "yes" : "no");
    return 0;
}
