// Why engine/kernels/vec_math.h and fused_ops.cpp write their generic-vector loops with 8-float
// vectors: the same loops over 16-float vectors (GCC vector extensions, target_clones) against the
// engine's 8-lane forms (vec_math.h, included here), in the clone this CPU runs. On AVX2, GCC
// lowers a 16-float vector's compares, selects and int conversions through memory. One thread;
// medians of 7 runs.
//   g++ -O3 -std=c++17 -Wno-psabi tools/fused_vector_width.cpp -o /tmp/fvw && /tmp/fvw
// Prints ms per call for: the exp-sum of a 151936-logit row (greedy_pick's second pass), the
// greedy_pick row in 16 lanes reduced every 64 logits and the engine's greedy_row (vec_math.h),
// and a 896-long dot product (rms_norm's sum of squares).
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "../engine/kernels/vec_math.h"

typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));

// exp_approx on 16 lanes (the form greedy_pick had)
TT_INLINE v16 exp_approx16(v16 x) {
    v16 n;
    const v16 p = exp_parts(x, n);
    const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
    return p * (v16)bits;
}
TT_INLINE float hmax16(v16 a) {
    const v8 lo = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7);
    const v8 hi = __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    return hmax(hi > lo ? hi : lo);
}

TT_CLONES float exp_sum16(const float* x, int64_t n, float mx) {
    v16 acc = {};
    for (int64_t j = 0; j + 16 <= n; j += 16) acc += exp_approx16(*(const v16*)(x + j) - mx);
    return hsum(acc);
}
TT_CLONES float exp_sum8(const float* x, int64_t n, float mx) {
    v8 a = {}, b = {};
    for (int64_t j = 0; j + 16 <= n; j += 16) {
        a += exp_approx8(*(const v8*)(x + j) - mx);
        b += exp_approx8(*(const v8*)(x + j + 8) - mx);
    }
    return hsum(v8(a + b));
}

// greedy_pick's row in 16 lanes: max and exp-sum per 64 logits, each block reduced at once
TT_CLONES float greedy_row16(const float* x, int64_t V, int64_t* id) {
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
        for (int64_t t = 0; t < 64; t += 16) acc += exp_approx16(*(const v16*)(x + j + t) - best);
        float a[16];
        for (int k = 0; k < 16; ++k) a[k] = acc[k];
        for (int w = 8; w > 0; w /= 2)
            for (int k = 0; k < w; ++k) a[k] += a[k + w];
        sum += a[0];
    }
    for (; j < V; ++j) sum += exp_approx(x[j] - best);
    *id = i;
    return float(-std::log(sum));
}

// the engine's greedy_row
static float greedy_row_engine(const float* x, int64_t V, int64_t* id) {
    float logprob;
    bool ok;
    greedy_row(x, V, id, &logprob, &ok);
    return logprob;
}

TT_CLONES float dot16(const float* a, const float* b, int64_t n) {
    v16 acc = {};
    for (int64_t i = 0; i + 16 <= n; i += 16) acc += *(const v16*)(a + i) * *(const v16*)(b + i);
    return hsum(acc);
}
// the engine's dot_f32, inlined into a clone (as into its callers there)
TT_CLONES float dot8x2(const float* a, const float* b, int64_t n) { return dot_f32(a, b, n); }

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

int main(int argc, char** argv) {
    if (argc > 1) {   // --help (or anything else): what it times, no timing
        printf("fused_vector_width: the fused ops' loops in 16-float vectors against vec_math.h's 8-float\n"
               "forms, one thread, ms per call (exp-sum, greedy_pick's row, a 896-long dot). No arguments.\n");
        return std::string(argv[1]) == "--help" ? 0 : 2;
    }
    const int64_t V = 151936, D = 896;
    std::vector<float> x(V);
    std::mt19937 g(1);
    std::normal_distribution<float> nd(0.0f, 4.0f);
    for (float& v : x) v = nd(g);
    volatile float sink;
    int64_t id16 = 0, id_engine = 0;
    const float lp16 = greedy_row16(x.data(), V, &id16), lp_engine = greedy_row_engine(x.data(), V, &id_engine);
    printf("greedy row: id %ld / %ld, logprob %.7f / %.7f (16 lanes / engine)\n", long(id16), long(id_engine),
           lp16, lp_engine);
    printf("exp-sum of %ld logits: 16 lanes %.4f ms, 8 lanes x2 %.4f ms\n", long(V),
           median_ms([&] { sink = exp_sum16(x.data(), V, 20.0f); }, 300),
           median_ms([&] { sink = exp_sum8(x.data(), V, 20.0f); }, 300));
    int64_t id;
    printf("greedy row: 16 lanes %.4f ms, engine %.4f ms\n", median_ms([&] { sink = greedy_row16(x.data(), V, &id); }, 300),
           median_ms([&] { sink = greedy_row_engine(x.data(), V, &id); }, 300));
    printf("dot of %ld: 16 lanes %.5f ms, 8 lanes x2 %.5f ms (same sums: %s)\n", long(D),
           median_ms([&] { sink = dot16(x.data(), x.data() + D, D); }, 20000),
           median_ms([&] { sink = dot8x2(x.data(), x.data() + D, D); }, 20000),
           dot16(x.data(), x.data() + D, D) == dot8x2(x.data(), x.data() + D, D) ? "yes" : "no");
    return 0;
}
