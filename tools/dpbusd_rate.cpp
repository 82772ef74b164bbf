// How fast this CPU issues the AVX2 panel dot's integer instructions, by operand form
// (engine/kernels/quant_avx2_panels.inc). Eight independent accumulators, 32-bit loads from L1:
//   g++ -O2 -o /tmp/dpbusd_rate tools/dpbusd_rate.cpp && /tmp/dpbusd_rate
// Prints ns per instruction (median of 5) and, from a chain of 1-cycle adds, the clock.
// Needs AVX-VNNI for the vpdpbusd lines (Intel Alder Lake and later, AMD Zen 5).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

using clk = std::chrono::steady_clock;
static int32_t mem[64 * 64 + 64];
static volatile int sink;

static double ns_since(clk::time_point t0, double n) {
    return std::chrono::duration<double>(clk::now() - t0).count() / n * 1e9;
}

__attribute__((noinline)) static double add_chain(long n) {   // one cycle each
    long a = 1;
    const auto t0 = clk::now();
    for (long k = 0; k < n; ++k) asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(a));
    return ns_since(t0, 4.0 * n);
}

// vpdpbusd whose activation operand is a 32-bit broadcast (BCAST = 1 per instruction, or one
// per two instructions: two tiles sharing it) or a full 256-bit load
template <int MODE>
__attribute__((target("avx2,avxvnni"), noinline)) static double dpbusd(long n) {
    __m256i acc[8];
    __m256i c = _mm256_set1_epi8(3), c2 = _mm256_set1_epi8(5);
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_set1_epi32(i);
    const auto t0 = clk::now();
    for (long k = 0; k < n; ++k) {
        const int32_t* m = mem + (k & 63) * 64;
        if constexpr (MODE == 0) {                 // a broadcast per vpdpbusd
#pragma GCC unroll 8
            for (int i = 0; i < 8; ++i) acc[i] = _mm256_dpbusd_avx_epi32(acc[i], c, _mm256_set1_epi32(m[i]));
        } else if constexpr (MODE == 1) {          // a broadcast per two (two tiles)
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) {
                const __m256i x = _mm256_set1_epi32(m[i]);
                acc[2 * i] = _mm256_dpbusd_avx_epi32(acc[2 * i], c, x);
                acc[2 * i + 1] = _mm256_dpbusd_avx_epi32(acc[2 * i + 1], c2, x);
            }
        } else {                                   // a full vector
#pragma GCC unroll 8
            for (int i = 0; i < 8; ++i)
                acc[i] = _mm256_dpbusd_avx_epi32(acc[i], c, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + 8 * i)));
        }
        asm volatile("" : "+x"(c), "+x"(c2));
    }
    const double ns = ns_since(t0, 8.0 * n);
    int s = 0;
    for (int i = 0; i < 8; ++i) s += _mm256_extract_epi32(acc[i], 0);
    sink = s;
    return ns;
}

// the maddubs build's step: maddubs, madd against ones, add (per 32 codes and row)
template <bool FULL>
__attribute__((target("avx2"), noinline)) static double maddubs(long n) {
    __m256i acc[8];
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i c = _mm256_set1_epi8(3);
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_set1_epi32(i);
    const auto t0 = clk::now();
    for (long k = 0; k < n; ++k) {
        const int32_t* m = mem + (k & 63) * 64;
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
            const __m256i x = FULL ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + 8 * i))
                                   : _mm256_set1_epi32(m[i]);
            acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(c, x), ones));
        }
        asm volatile("" : "+x"(c));
    }
    const double ns = ns_since(t0, 8.0 * n);
    int s = 0;
    for (int i = 0; i < 8; ++i) s += _mm256_extract_epi32(acc[i], 0);
    sink = s;
    return ns;
}

int main(int argc, char** argv) {
    if (argc > 1) {   // --help (or anything else): what it times, no timing
        std::printf("dpbusd_rate: ns per AVX2 dot instruction by operand form (vpdpbusd with a broadcast,\n"
                    "shared or full-vector operand; maddubs+madd+add), and per cycle. No arguments.\n");
        return std::strcmp(argv[1], "--help") == 0 ? 0 : 2;
    }
    for (int i = 0; i < 64 * 64; ++i) mem[i] = int32_t(i * 2654435761u);
    const long n = 20000000;
    const char* names[] = {"1-cycle add", "vpdpbusd, broadcast operand", "vpdpbusd, broadcast shared by two",
                           "vpdpbusd, full-vector operand", "maddubs+madd+add, broadcast", "maddubs+madd+add, full"};
    std::vector<double> runs[6];
    __builtin_cpu_init();
    const bool vnni = __builtin_cpu_supports("avxvnni");
    for (int r = 0; r < 5; ++r) {
        runs[0].push_back(add_chain(3 * n));
        if (vnni) {
            runs[1].push_back(dpbusd<0>(n));
            runs[2].push_back(dpbusd<1>(n));
            runs[3].push_back(dpbusd<2>(n));
        }
        runs[4].push_back(maddubs<false>(n));
        runs[5].push_back(maddubs<true>(n));
    }
    double cycle = 0;
    for (int i = 0; i < 6; ++i) {
        if (runs[i].empty()) continue;
        std::sort(runs[i].begin(), runs[i].end());
        const double med = runs[i][2];
        if (i == 0) cycle = med;
        std::printf("%-36s %.3f ns  (%.2f per cycle)\n", names[i], med, cycle / med);
    }
    if (!vnni) std::printf("(no AVX-VNNI: vpdpbusd not measured)\n");
}
