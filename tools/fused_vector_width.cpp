// Why engine/kernels/vec_math.h builds its vector loops in two widths (TT_BY_WIDTH): the same
// loops over 16-float and 8-float vectors (GCC vector extensions, target_clones), in the clone
// this CPU runs. On AVX2, GCC lowers a 16-float vector's compares, selects and int conversions
// through memory; on AVX-512 the 8-float form runs at a fraction of the 16-float one's speed.
// One thread; medians of 7 runs.
//   g++ -O3 -std=c++17 -Wno-psabi tools/fused_vector_width.cpp -o /tmp/fvw && /tmp/fvw
// Prints ms per call for: the exp-sum of a 151936-logit row (greedy_pick's second pass),
// greedy_pick's row (vec_math.h greedy_row_w) and a 896-long dot product (rms_norm's sum of
// squares), each in 16 and 8 lanes.
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "../engine/kernels/vec_math.h"

TT_CLONES float exp_sum16(const float* x, int64_t n, float mx) {
    v16 acc = {};
    for (int64_t j = 0; j + 16 <= n; j += 16) acc += exp_approxv(load_lanes<v16>(x + j) - mx);
    return hsum(acc);
}
TT_CLONES float exp_sum8(const float* x, int64_t n, float mx) {
    v8 a = {}, b = {};
    for (int64_t j = 0; j + 16 <= n; j += 16) {
        a += exp_approxv(load_lanes<v8>(x + j) - mx);
        b += exp_approxv(load_lanes<v8>(x + j + 8) - mx);
    }
    return hsum(v8(a + b));
}

// greedy_pick's row (vec_math.h greedy_row_w) in either width, in the clone this CPU runs
TT_CLONES float greedy_row16(const float* x, int64_t V, int64_t* id) {
    float logprob;
    bool ok;
    greedy_row_w<v16>(x, V, true, id, &logprob, &ok);
    return logprob;
}
TT_CLONES float greedy_row8(const float* x, int64_t V, int64_t* id) {
    float logprob;
    bool ok;
    greedy_row_w<v8>(x, V, true, id, &logprob, &ok);
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
        printf("fused_vector_width: the fused ops' loops in 16-float vectors against 8-float ones,\n"
               "one thread, ms per call (exp-sum, greedy_pick's row, a 896-long dot). No arguments.\n");
        return std::string(argv[1]) == "--help" ? 0 : 2;
    }
    const int64_t V = 151936, D = 896;
    std::vector<float> x(V);
    std::mt19937 g(1);
    std::normal_distribution<float> nd(0.0f, 4.0f);
    for (float& v : x) v = nd(g);
    volatile float sink;
    int64_t id16 = 0, id8 = 0;
    const float lp16 = greedy_row16(x.data(), V, &id16), lp8 = greedy_row8(x.data(), V, &id8);
    printf("greedy row: id %ld / %ld, logprob %.7f / %.7f (16 lanes / 8 lanes)\n", long(id16), long(id8), lp16, lp8);
    printf("exp-sum of %ld logits: 16 lanes %.4f ms, 8 lanes x2 %.4f ms\n", long(V),
           median_ms([&] { sink = exp_sum16(x.data(), V, 20.0f); }, 300),
           median_ms([&] { sink = exp_sum8(x.data(), V, 20.0f); }, 300));
    int64_t id;
    printf("greedy row: 16 lanes %.4f ms, 8 lanes %.4f ms\n", median_ms([&] { sink = greedy_row16(x.data(), V, &id); }, 300),
           median_ms([&] { sink = greedy_row8(x.data(), V, &id); }, 300));
    printf("dot of %ld: 16 lanes %.5f ms, 8 lanes x2 %.5f ms (same sums: %s)\n", long(D),
           median_ms([&] { sink = dot16(x.data(), x.data() + D, D); }, 20000),
           median_ms([&] { sink = dot8x2(x.data(), x.data() + D, D); }, 20000),
           dot16(x.data(), x.data() + D, D) == dot8x2(x.data(), x.data() + D, D) ? "yes" : "no");
    return 0;
}
