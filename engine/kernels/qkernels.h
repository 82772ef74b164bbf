// Quantized matmul kernels over raw GGUF blocks: plain C++, no torch headers (fast to compile).
// Which kernel file serves which call size and ISA: the table atop qkernels.cpp.
#pragma once
#include <cstdint>
#include <vector>

namespace tt {

enum Isa : int { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

// GGML type ids (gguf.GGMLQuantizationType)
enum QType : int { Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

int best_isa();                          // what this CPU runs (cpuid)
int64_t block_weights(int type);         // weights per block: 32 or 256; 0 if unsupported
int64_t block_bytes(int type);

// Activation rows quantized once per call: per 32-group g, d_g = amax_g / 127 and
// a_i = round(x_i / d_g) in [-127, 127]; dl holds d_g per 4-weight lane (K/4 floats), as16 holds
// d_g * (sum of a_i over each 16 weights) (K/16 floats).
void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K,
                   int8_t* a, float* dl, float* as16);

// y[m * ldy + n] = sum_k W[n, k] * xhat[m, k] for output rows n in [n0, n1) of one GGUF matrix
// `w` (rows of block_bytes * K / block_weights bytes), every activation row m < M.
void matmul_rows(int isa, int type, const uint8_t* w, int64_t K, int64_t n0, int64_t n1,
                 const int8_t* a, const float* dl, const float* as16, int64_t M,
                 float* y, int64_t ldy);

// Whether `isa` has the direct kernels (AVX2 and AVX-512; the portable path keeps unpacking).
bool has_direct(int isa);

// Calls of at most this many rows take the direct kernels by default on `isa` (their measured
// break-even against the panels, tools/kernel_bench.py; qkernels.cpp); 0 where it has none.
int64_t direct_max_rows(int isa);

// The same product as matmul_rows, block to register with no unpacked copy: for a few rows M
// (decode, small batches), where unpacking costs more than the dot products. Batch-invariant
// within itself, but not bitwise equal to matmul_rows.
//
// The direct kernels quantize the activations as each weight type is scaled: Q4_0 / Q5_0 /
// Q8_0 per 32 weights, the K-quants per 256 like llama.cpp's Q8_K, so that a super-block's dot
// product stays in integers. Per activation row (K values), the forms quantize_direct fills
// (those whose pointers are set; the others stay null):
//   AVX-512, 32-wise: au = a + 128 (uint8, K), dl = d_g per 4-weight lane (K/4)
//   AVX2, 32-wise:    a (int8, K), d32 (K/32), ls = sums of each 4 a (K/4)
//   K-quants, both:   ak (int8, K), dk (K/256), as16k / as32k = dk * the sum of ak over each
//                     16 / 32 weights (K/16, K/32; left out when null: the packed K-quants
//                     read only ak and dk)
struct DirectActs {
    uint8_t* au = nullptr;
    float* dl = nullptr;
    int8_t* a = nullptr;
    float* d32 = nullptr;
    int32_t* ls = nullptr;
    int8_t* ak = nullptr;
    float* dk = nullptr;
    float* as16k = nullptr;
    float* as32k = nullptr;
};
bool is_k_quant(int type);
void quantize_direct(int isa, const float* x, int64_t ldx, int64_t M, int64_t K, const DirectActs& out);
void matmul_direct(int isa, int type, const uint8_t* w, int64_t K, int64_t n0, int64_t n1, const DirectActs& act,
                   int64_t M, float* y, int64_t ldy);

// Batches and prefill (more activation rows than direct_max_rows): whether `isa` has the panel kernel (AVX-512,
// AVX2), and the kernel. It unpacks a panel of output rows over all of K once and runs every
// activation row through it with the accumulators in registers (quant_avx512_panels.inc,
// quant_avx2_panels.inc: the same bits). Not bitwise equal to matmul_rows (code offsets are
// subtracted in the integers, K-quant scales applied per 32).
bool has_panels(int isa);
bool use_avx_vnni();                     // the AVX2 panels and direct kernels take AVX-VNNI's vpdpbusd (cpuid, TOKENTOP_AVX_VNNI)
int64_t panel_rows(int isa);             // output rows per panel: the unit threads take
// Q8_0 calls of lane_min_rows(isa) to 8 rows take the AVX2 row-lane kernel (quant_avx2_panels.inc;
// the panels' bits) instead of the panels' tiles; 0 where none does (other ISAs, AVX-VNNI)
int64_t lane_min_rows(int isa);
// quantize_rows' a (the same values) and, per activation row, d32 the scale of each 32-group
// (K/32), as32 = d32 * (sum of the group's a) (K/32), is16 the sum of each 16 a (K/16), in one
// pass (has_panels ISAs only).
void quantize_panel_rows(int isa, const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* a, float* d32,
                         float* as32, int32_t* is16);
// The panels' integer starts (both instruction sets): init[m * (K / grp) + g] = -offset * (the
// sum of activation row m's g-th group of grp, from is16); returns init's data.
const int32_t* panel_starts(int32_t offset, int64_t grp, const int32_t* is16, int64_t M, int64_t K);
void matmul_panels(int isa, int type, const uint8_t* w, int64_t K, int64_t n0, int64_t n1,
                   const int8_t* a, const float* d32, const float* as32, const int32_t* is16, int64_t M,
                   float* y, int64_t ldy);

// Matrices repacked for the AVX-512 panels (quant_avx512_packed.inc): whether `isa` has them for
// `type`, the packed size of a matrix, the packing of its 16-row tiles [t0, t1) into `out`
// (packed_bytes long), and the product over the packed form. Q4_0 / Q5_0 /
// Q8_0 read the panels' activations (a, d32, is16) and give the built panels' bits; the K-quants
// read the direct kernels' 256-wise ones (ak, dk) and keep a super-block's sum in integers (not
// the built panels' bits; batch-invariant within themselves).
bool has_packed(int isa, int type);     // false with TOKENTOP_PACKED=0
bool packed_one_row(int isa, int type); // one-row calls of `type` read the packed copy too (Q5_0, K-quants)
bool use_packed();
bool packed_prefetch_l2();              // the packed kernels prefetch into L2 (TOKENTOP_PACKED_PREFETCH=l2)
int64_t packed_max_rows();              // calls of more rows build their panels from the blocks
int64_t packed_bytes(int type, int64_t rows, int64_t K);
void pack_tiles(int type, const uint8_t* w, int64_t rows, int64_t K, int64_t t0, int64_t t1, uint8_t* out);
// The activations of a call as the packed kernels read them: made once per call and type by
// prepare_packed, then shared by the threads (each computes its ranges of output rows).
struct PackedActs {
    std::vector<int32_t> ail;   // rows interleaved by 4 bytes, per block of 8 rows
    std::vector<float> s8;      // per block of 8 rows: a scale per 32 weights (K-quants: per 256)
    std::vector<int32_t> i8;    // and an integer per 32 weights (K-quants: two groups' sums)
};
void prepare_packed(int type, int64_t K, const int8_t* a, const float* d32, const int32_t* is16, const int8_t* ak,
                    const float* dk, int64_t M, PackedActs& out);
void matmul_packed(int type, const uint8_t* packed, int64_t rows, int64_t K, int64_t n0, int64_t n1,
                   const PackedActs& acts, int64_t M, float* y, int64_t ldy);

}  // namespace tt
