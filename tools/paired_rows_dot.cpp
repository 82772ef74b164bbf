// Tried and dropped (docs/benchmarks.md, thirteenth pass): the AVX2 maddubs tile dot with its
// activation broadcasts replaced by full-vector loads. The panels' dot (qkernels_panels_avx2.inc,
// tile_dot8) broadcasts 4 activation bytes per activation row and code vector (vpbroadcastd); the
// variant reads each 8-row code vector as two 4-row halves (vbroadcasti128) against precomputed
// pair vectors [row j's 4 bytes x4 | row j+1's 4 bytes x4], so every activation operand is a
// plain 32-byte load. Same integer sums, same float steps, same bits (checked below), but
// 0.8-0.85x the current loop's rate on Zen 3: the broadcasts were not what limits it.
// One thread, one 8-row tile and 8 activation rows in L1 (random Q5_0-range codes), K = 896 and
// 4864:
//   g++ -O3 -march=haswell -mtune=znver3 -o /tmp/paired_rows_dot tools/paired_rows_dot.cpp
//   /tmp/paired_rows_dot 896; /tmp/paired_rows_dot 4864
// (an optional second argument cycles that many distinct tiles, to take them out of L1; the
// third column is the current loop in blocks of 2 rows instead of 4). The two loops are kept
// side by side on purpose: they differ only in how the operands are loaded.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <vector>
static const int M = 8;
template <int MB>
__attribute__((noinline)) void old_tile(const uint8_t* cil, const float* wsil, const int8_t* a, const float* d32, int64_t K, float* y) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int m0 = 0; m0 < M; m0 += MB) {
        __m256 acc[MB];
        for (int j = 0; j < MB; ++j) acc[j] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 32) {
            __m256i id[MB];
            for (int j = 0; j < MB; ++j) id[j] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int q = 0; q < 8; q += 4) {
                __m256i c[4];
                for (int i = 0; i < 4; ++i) c[i] = _mm256_loadu_si256((const __m256i*)(cil + (k / 4 + q + i) * 32));
                for (int j = 0; j < MB; ++j) {
                    __m256i p16 = _mm256_setzero_si256();
                    for (int i = 0; i < 4; ++i) {
                        int32_t x; std::memcpy(&x, a + (m0 + j) * K + k + 4 * (q + i), 4);
                        const __m256i m = _mm256_maddubs_epi16(c[i], _mm256_set1_epi32(x));
                        p16 = i == 0 ? m : _mm256_add_epi16(p16, m);
                    }
                    id[j] = _mm256_add_epi32(id[j], _mm256_madd_epi16(p16, ones));
                }
            }
            for (int j = 0; j < MB; ++j) {
                const __m256 dg = _mm256_set1_ps(d32[(m0 + j) * (K / 32) + k / 32]);
                const __m256 ws = _mm256_loadu_ps(wsil + 8 * (k / 16));
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(id[j]), _mm256_mul_ps(ws, dg), acc[j]);
            }
        }
        for (int j = 0; j < MB; ++j) _mm256_storeu_ps(y + (m0 + j) * 8, acc[j]);
    }
}
// ap: [pair p][quad] 32 bytes; dp: [pair][group] 8 floats
__attribute__((noinline)) void new_tile(const uint8_t* cil, const float* wsil, const int8_t* ap, const float* dp, int64_t K, float* y) {
    const __m256i ones = _mm256_set1_epi16(1);
    constexpr int P = M / 2;
    for (int h = 0; h < 2; ++h) {
        __m256 acc[P];
        for (int p = 0; p < P; ++p) acc[p] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 32) {
            __m256i id[P];
            for (int p = 0; p < P; ++p) id[p] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int q = 0; q < 8; q += 4) {
                __m256i c[4];
                for (int i = 0; i < 4; ++i) c[i] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(cil + (k / 4 + q + i) * 32 + 16 * h)));
                for (int p = 0; p < P; ++p) {
                    __m256i p16 = _mm256_setzero_si256();
                    for (int i = 0; i < 4; ++i) {
                        const __m256i x = _mm256_loadu_si256((const __m256i*)(ap + (p * (K / 4) + k / 4 + q + i) * 32));
                        const __m256i m = _mm256_maddubs_epi16(c[i], x);
                        p16 = i == 0 ? m : _mm256_add_epi16(p16, m);
                    }
                    id[p] = _mm256_add_epi32(id[p], _mm256_madd_epi16(p16, ones));
                }
            }
            const __m256 ws = _mm256_broadcast_ps((const __m128*)(wsil + 8 * (k / 16) + 4 * h));
            for (int p = 0; p < P; ++p) {
                const __m256 dg = _mm256_loadu_ps(dp + (p * (K / 32) + k / 32) * 8);
                acc[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(id[p]), _mm256_mul_ps(ws, dg), acc[p]);
            }
        }
        for (int p = 0; p < P; ++p) {
            alignas(32) float t[8]; _mm256_store_ps(t, acc[p]);
            for (int r = 0; r < 4; ++r) { y[(2 * p) * 8 + 4 * h + r] = t[r]; y[(2 * p + 1) * 8 + 4 * h + r] = t[4 + r]; }
        }
    }
}
int main(int argc, char** argv) {
    int64_t K = argc > 1 ? atol(argv[1]) : 896;
    int ntiles = argc > 2 ? atoi(argv[2]) : 1;      // distinct tiles cycled (1: L1-resident)
    std::vector<uint8_t> cil(ntiles * 8 * K);
    std::vector<float> ws(ntiles * (K / 16) * 8);
    for (auto& c : cil) c = rand() % 32;
    for (auto& w : ws) w = (rand() % 1000) / 1000.0f;
    std::vector<int8_t> a(M * K);
    for (auto& x : a) x = int8_t(rand() % 255 - 127);
    std::vector<float> d32(M * (K / 32));
    for (auto& d : d32) d = (rand() % 1000) / 1000.0f;
    std::vector<int8_t> ap(M / 2 * (K / 4) * 32);
    std::vector<float> dp(M / 2 * (K / 32) * 8);
    for (int p = 0; p < M / 2; ++p) {
        for (int64_t q = 0; q < K / 4; ++q)
            for (int r = 0; r < 8; ++r) std::memcpy(&ap[(p * (K / 4) + q) * 32 + 4 * r], &a[(2 * p + r / 4) * K + 4 * q], 4);
        for (int64_t g = 0; g < K / 32; ++g)
            for (int r = 0; r < 8; ++r) dp[(p * (K / 32) + g) * 8 + r] = d32[(2 * p + r / 4) * (K / 32) + g];
    }
    float y0[64], y1[64], y2[64];
    old_tile<4>(cil.data(), ws.data(), a.data(), d32.data(), K, y0);
    new_tile(cil.data(), ws.data(), ap.data(), dp.data(), K, y1);
    old_tile<2>(cil.data(), ws.data(), a.data(), d32.data(), K, y2);
    int same = 0; for (int i = 0; i < 64; ++i) same += y0[i] == y1[i] && y0[i] == y2[i];
    printf("same bits: %d / 64\n", same);
    const int reps = int(4e8 / (64 * K));
    for (int round = 0; round < 5; ++round) {
        double t[3];
        for (int v = 0; v < 3; ++v) {
            auto t0 = std::chrono::steady_clock::now();
            for (int r = 0; r < reps; ++r) {
                int ti = r % ntiles;
                if (v == 0) old_tile<4>(cil.data() + ti * 8 * K, ws.data() + ti * (K / 16) * 8, a.data(), d32.data(), K, y0);
                else if (v == 1) new_tile(cil.data() + ti * 8 * K, ws.data() + ti * (K / 16) * 8, ap.data(), dp.data(), K, y1);
                else old_tile<2>(cil.data() + ti * 8 * K, ws.data() + ti * (K / 16) * 8, a.data(), d32.data(), K, y2);
            }
            t[v] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        }
        double mac = double(reps) * 64 * K;
        printf("K=%ld old(MB4) %.1f  new(pairs) %.1f  old(MB2) %.1f GMAC/s one thread\n", (long)K, mac / t[0] / 1e9, mac / t[1] / 1e9, mac / t[2] / 1e9);
    }
}
