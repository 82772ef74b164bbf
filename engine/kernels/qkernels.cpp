// The kernels of qkernels.h for every x86 CPU in one translation unit: each instruction set's
// files are compiled in a namespace of their own under `#pragma GCC target`, and the ISA is
// picked at run time (best_isa, capped by TOKENTOP_KERNEL_ISA).
//
// Which file serves a call of M activation rows (qmatmul_op.cpp picks; its defaults):
//                       M <= direct_max_rows       more rows                 deterministic mode
//   portable (scalar)   quant_generic.inc          quant_generic.inc         quant_generic.inc
//   AVX2 + FMA + F16C   quant_avx2_direct.inc      quant_avx2_panels.inc     quant_avx2_rows.inc
//   AVX-512 + VNNI      quant_avx512_direct.inc    quant_avx512_panels.inc   quant_avx512_tiles.inc
//                                                  (to 32 rows: _packed.inc)
// direct_max_rows is 4, except 1 on AVX-512 with the packed panels (TOKENTOP_PACKED), where
// one-row calls of Q5_0, Q8_0 and K-quant matrices alone read the packed copies too.
// Deterministic mode (small_m = 0) takes the last column at every M, so that a row's bits do not
// depend on its batch; a forced small_m / big_m moves the thresholds (tests, benchmarks). On AVX2
// where the CPU has AVX-VNNI (unless TOKENTOP_AVX_VNNI=0), the direct kernels and panels run from
// a second build of their files with vpdpbusd dots (isa_avx2vnni, the same bits); without it,
// Q8_0 calls of 7-8 rows take the row lanes of quant_avx2_panels.inc. quant_unpack.inc, a weight
// row's GGUF blocks to the unpacked form that the row and tile kernels read, is built into every
// ISA's namespace.
#include "qkernels.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TT_X86 1
#else
#define TT_X86 0
#endif

// The AVX-VNNI build of the AVX2 kernels needs a compiler that knows the instruction set
// (GCC 11, clang 12); older ones build the rest and use maddubs.
#if TT_X86 && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define TT_AVXVNNI_BUILD 1
#else
#define TT_AVXVNNI_BUILD 0
#endif

namespace tt {

const int32_t* panel_starts(int32_t offset, int64_t grp, const int32_t* is16, int64_t M, int64_t K) {
    // once per call and thread (in the loop of every panel it cost a few scalar operations per
    // row and step); the calling thread's buffer
    thread_local std::vector<int32_t> init;
    const int64_t n_grp = K / grp;
    init.resize(size_t(M * n_grp));
    for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < n_grp; ++g) {
            const int32_t* is = is16 + m * (K / 16) + g * (grp / 16);
            init[m * n_grp + g] = -offset * (grp == 16 ? is[0] : is[0] + is[1]);
        }
    return init.data();
}

namespace isa_scalar {
#define TT_LEVEL 0
#include "quant_unpack.inc"
#include "quant_generic.inc"
#undef TT_LEVEL
}  // namespace isa_scalar

#if TT_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
#define TT_LEVEL 1
#define TT_AVXVNNI 0
#include "quant_unpack.inc"
#include "quant_avx2_rows.inc"
#include "quant_avx2_direct.inc"
#include "quant_avx2_panels.inc"
#undef TT_AVXVNNI
#undef TT_LEVEL
}  // namespace isa_avx2
#pragma GCC pop_options

// The AVX2 kernels again with AVX-VNNI's vpdpbusd for the integer dots: the direct kernels
// (quant_avx2_direct.inc's dot4) and the panels (quant_avx2_panels.inc)
#if TT_AVXVNNI_BUILD
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace isa_avx2vnni {
#define TT_LEVEL 1
#define TT_AVXVNNI 1
#include "quant_unpack.inc"
#include "quant_avx2_rows.inc"
#include "quant_avx2_direct.inc"
#include "quant_avx2_panels.inc"
#undef TT_AVXVNNI
#undef TT_LEVEL
}  // namespace isa_avx2vnni
#pragma GCC pop_options
#endif

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
namespace isa_avx512 {
#define TT_LEVEL 2
#include "quant_unpack.inc"
#include "quant_avx512_tiles.inc"
#include "quant_avx512_direct.inc"
#include "quant_avx512_panels.inc"
#include "quant_avx512_packed.inc"
#undef TT_LEVEL
}  // namespace isa_avx512
#pragma GCC pop_options
#endif

int best_isa() {
#if TT_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        return ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;
#endif
    return ISA_SCALAR;
}

int64_t block_weights(int type) {
    switch (type) {
    case Q4_0: case Q5_0: case Q8_0: return 32;
    case Q4_K: case Q5_K: case Q6_K: return 256;
    default: return 0;
    }
}

int64_t block_bytes(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q5_0: return 22;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* a, float* dl, float* as16) {
    for (int64_t m = 0; m < M; ++m) {
        const float* xm = x + m * ldx;
        int8_t* am = a + m * K;
        for (int64_t g = 0; g < K / 32; ++g) {
            const float* xg = xm + 32 * g;
            float amax = 0.0f;
            for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(xg[i]));
            const float d = amax / 127.0f;
            const float id = d > 0.0f ? 1.0f / d : 0.0f;
            int32_t sums[2] = {0, 0};
            for (int i = 0; i < 32; ++i) {
                float q = std::nearbyint(xg[i] * id);        // round half to even
                q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
                const int32_t qi = int32_t(q);
                am[32 * g + i] = int8_t(qi);
                sums[i / 16] += qi;
            }
            for (int l = 0; l < 8; ++l) dl[m * (K / 4) + 8 * g + l] = d;
            as16[m * (K / 16) + 2 * g] = d * float(sums[0]);
            as16[m * (K / 16) + 2 * g + 1] = d * float(sums[1]);
        }
    }
}

void matmul_rows(int isa, int type, const uint8_t* w, int64_t K, int64_t n0, int64_t n1,
                 const int8_t* a, const float* dl, const float* as16, int64_t M, float* y, int64_t ldy) {
    const int64_t row_bytes = K / block_weights(type) * block_bytes(type);
    const int64_t per_row = (2 * K + K / 4 + 63) / 64 * 64;
    const int64_t R = M <= 4 ? 1 : 8;        // rows unpacked together: each serves all M
    thread_local std::vector<uint8_t> scratch;
#if TT_X86
    if (isa == ISA_AVX512) {
        const size_t need = isa_avx512::tile_scratch_bytes(M);
        if (scratch.size() < need) scratch.resize(need);
        return isa_avx512::matmul_tiles(type, w, row_bytes, K, n0, n1, a, dl, as16, M, y, ldy,
                                        scratch.data());
    }
#endif
    if (scratch.size() < size_t(R * per_row)) scratch.resize(R * per_row);
#if TT_X86
    if (isa == ISA_AVX2)
        return isa_avx2::matmul_rows_impl(type, w, row_bytes, K, n0, n1, a, dl, as16, M, y, ldy,
                                          type == Q8_0, R, scratch.data(), per_row);
#endif
    isa_scalar::matmul_rows_impl(type, w, row_bytes, K, n0, n1, a, dl, as16, M, y, ldy, false, R,
                                 scratch.data(), per_row);
}

bool has_direct(int isa) { return TT_X86 && isa >= ISA_AVX2; }

int64_t direct_max_rows(int isa) {
    if (!has_direct(isa)) return 0;
    // on all linear layers of a step the direct kernels beat the panels (qmatmul_op.cpp) up to
    // 4 rows on AVX2; on AVX-512 the panels over packed K-quants (and the GGUF panels of the
    // other types) are level with them at 2 rows and ahead from 3 (docs/kernels.md, 'K-quants
    // packed for the panels'), so only one-row calls keep them
    return isa == ISA_AVX512 && use_packed() ? 1 : 4;
}

// the packed K-quant panels: on unless TOKENTOP_PACKED=0 (read per call, so that A/B runs and
// tests can compare both)
bool use_packed() {
    const char* s = std::getenv("TOKENTOP_PACKED");
    return !(s && std::strcmp(s, "0") == 0);
}

// where the packed kernels prefetch the next panel: L2 with TOKENTOP_PACKED_PREFETCH=l2, else L1
// (read per call; engine/worker/prefetch.py sets it from a measurement on this machine)
bool packed_prefetch_l2() {
    const char* s = std::getenv("TOKENTOP_PACKED_PREFETCH");
    return s && std::strcmp(s, "l2") == 0;
}

bool is_k_quant(int type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

void quantize_direct(int isa, const float* x, int64_t ldx, int64_t M, int64_t K, const DirectActs& out) {
#if TT_X86
    if (isa == ISA_AVX512) return isa_avx512::quantize_direct512(x, ldx, M, K, out);
    if (isa == ISA_AVX2) return isa_avx2::quantize_direct(x, ldx, M, K, out);
#endif
    (void)isa; (void)x; (void)ldx; (void)M; (void)K; (void)out;
}

void matmul_direct(int isa, int type, const uint8_t* w, int64_t K, int64_t n0, int64_t n1, const DirectActs& act,
                   int64_t M, float* y, int64_t ldy) {
    const int64_t row_bytes = K / block_weights(type) * block_bytes(type);
#if TT_X86
    if (isa == ISA_AVX512) return isa_avx512::matmul_direct512(type, w, row_bytes, K, n0, n1, act, M, y, ldy);
#if TT_AVXVNNI_BUILD
    if (isa == ISA_AVX2 && use_avx_vnni())
        return isa_avx2vnni::matmul_direct(type, w, row_bytes, K, n0, n1, act, M, y, ldy);
#endif
    if (isa == ISA_AVX2) return isa_avx2::matmul_direct(type, w, row_bytes, K, n0, n1, act, M, y, ldy);
#endif
    (void)isa; (void)type; (void)w; (void)row_bytes; (void)n0; (void)n1; (void)act; (void)M; (void)y; (void)ldy;
}

// AVX-VNNI for the AVX2 panels and direct kernels: where the CPU has it, unless
// TOKENTOP_AVX_VNNI=0 (read per call, so a test can compare both builds)
bool use_avx_vnni() {
#if TT_AVXVNNI_BUILD
    static const bool has = [] { __builtin_cpu_init(); return __builtin_cpu_supports("avxvnni") != 0; }();
    const char* s = std::getenv("TOKENTOP_AVX_VNNI");
    return has && !(s && std::strcmp(s, "0") == 0);
#else
    return false;
#endif
}

bool has_panels(int isa) { return TT_X86 && (isa == ISA_AVX512 || isa == ISA_AVX2); }

int64_t lane_min_rows(int isa) {
#if TT_X86
    return isa == ISA_AVX2 && !use_avx_vnni() ? isa_avx2::LANE_MIN_ROWS : 0;
#else
    (void)isa;
    return 0;
#endif
}

int64_t panel_rows(int isa) {
#if TT_X86
    return isa == ISA_AVX2 ? isa_avx2::P2_ROWS : isa_avx512::PANEL_ROWS;
#else
    (void)isa;
    return 32;
#endif
}

void quantize_panel_rows(int isa, const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* a, float* d32,
                         float* as32, int32_t* is16) {
#if TT_X86
    if (isa == ISA_AVX512) return isa_avx512::quantize_panel_rows(x, ldx, M, K, a, d32, as32, is16);
    if (isa == ISA_AVX2) return isa_avx2::quantize_panel_rows(x, ldx, M, K, a, d32, as32, is16);
#endif
    (void)isa; (void)x; (void)ldx; (void)M; (void)K; (void)a; (void)d32; (void)as32; (void)is16;
}

void matmul_panels(int isa, int type, const uint8_t* w, int64_t K, int64_t n0, int64_t n1, const int8_t* a,
                   const float* d32, const float* as32, const int32_t* is16, int64_t M, float* y, int64_t ldy) {
#if TT_X86
    if (has_panels(isa)) {
        thread_local std::vector<uint8_t> scratch;   // the panel being built and computed
        const size_t need = isa == ISA_AVX2 ? isa_avx2::panel_scratch_bytes(K) : isa_avx512::panel_scratch_bytes(K);
        if (scratch.size() < need) scratch.resize(need);
        const int64_t row_bytes = K / block_weights(type) * block_bytes(type);
        if (isa == ISA_AVX512)
            return isa_avx512::matmul_panels(type, w, row_bytes, K, n0, n1, a, d32, as32, is16, M, y, ldy,
                                             scratch.data());
#if TT_AVXVNNI_BUILD
        if (use_avx_vnni())
            return isa_avx2vnni::matmul_panels(type, w, row_bytes, K, n0, n1, a, d32, as32, is16, M, y, ldy,
                                               scratch.data());
#endif
        return isa_avx2::matmul_panels(type, w, row_bytes, K, n0, n1, a, d32, as32, is16, M, y, ldy,
                                       scratch.data());
    }
#endif
    (void)isa; (void)type; (void)w; (void)K; (void)n0; (void)n1; (void)a; (void)d32; (void)as32; (void)is16;
    (void)M; (void)y; (void)ldy;
}

bool has_packed(int isa, int type) {
    return TT_X86 && isa == ISA_AVX512 && block_weights(type) > 0 && use_packed();
}

// transparent huge pages on request or always (the packed copies ask for them: qmatmul_op.cpp)
static bool huge_pages_on() {
    static const bool on = [] {
        char buf[128] = {0};
        FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
        if (!f) return false;
        const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
        std::fclose(f);
        buf[n] = 0;
        return std::strstr(buf, "[always]") || std::strstr(buf, "[madvise]");
    }();
    return on;
}

// one-row calls of Q5_0, Q8_0 and the K-quants read the packed copy too: Q5_0's direct kernel is
// compute-bound, and the K-quants' is too (17 GB/s a thread from cache, against 47 for the
// packed dot, whose copy is the GGUF size); with Q8_0's (the 0.5B's head and v) the 0.5B's step
// was 1.05x faster. Streamed from memory in 4 KiB pages the K-quant copies were slower than the
// direct kernel (0.91x, the 1.5B), so those need huge pages (docs/kernels.md, 'K-quants packed
// for one row', 'Q4_0, Q5_0 and Q8_0 packed too').
bool packed_one_row(int isa, int type) {
    return (type == Q5_0 || type == Q8_0 || (is_k_quant(type) && huge_pages_on())) && has_packed(isa, type);
}

int64_t packed_max_rows() {
#if TT_X86
    return isa_avx512::PACKED_MAX_ROWS;
#else
    return 0;
#endif
}

int64_t packed_bytes(int type, int64_t rows, int64_t K) {
#if TT_X86
    return (rows + 15) / 16 * isa_avx512::packed_tile_bytes(type, K);
#else
    (void)type; (void)rows; (void)K;
    return 0;
#endif
}

void pack_tiles(int type, const uint8_t* w, int64_t rows, int64_t K, int64_t t0, int64_t t1, uint8_t* out) {
#if TT_X86
    isa_avx512::pack_tiles(type, w, rows, K, t0, t1, out);
#else
    (void)type; (void)w; (void)rows; (void)K; (void)t0; (void)t1; (void)out;
#endif
}

void prepare_packed(int type, int64_t K, const int8_t* a, const float* d32, const int32_t* is16, const int8_t* ak,
                    const float* dk, int64_t M, PackedActs& out) {
#if TT_X86
    isa_avx512::prepare_packed(type, K, a, d32, is16, ak, dk, M, out);
#else
    (void)type; (void)K; (void)a; (void)d32; (void)is16; (void)ak; (void)dk; (void)M; (void)out;
#endif
}

void matmul_packed(int type, const uint8_t* packed, int64_t rows, int64_t K, int64_t n0, int64_t n1,
                   const PackedActs& acts, int64_t M, float* y, int64_t ldy) {
#if TT_X86
    isa_avx512::matmul_packed(type, packed, rows, K, n0, n1, acts, M, y, ldy);
#else
    (void)type; (void)packed; (void)rows; (void)K; (void)n0; (void)n1; (void)acts; (void)M; (void)y; (void)ldy;
#endif
}

}  // namespace tt
