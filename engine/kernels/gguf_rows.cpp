// tokentop::gguf_rows_dot: exact fp32 dot products of activation rows with a few rows of a GGUF
// matrix, each row dequantized as ggml does (the decoder's _refine of the top logit candidates).
//
// In numpy, dequantizing the 32 candidate rows of each sequence took a visible share of a decode
// step, on one thread (docs/kernels.md, 'One call per decode step, one weight row at a time');
// here each (row, candidate) is one task: dequantize the row's blocks into a buffer, then one dot
// product with 16 partial sums in a fixed order, so a result does not depend on the batch.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "qkernels.h"

namespace {

using tt::block_bytes;
using tt::block_weights;
using tt::Q4_0;
using tt::Q4_K;
using tt::Q5_0;
using tt::Q5_K;
using tt::Q6_K;
using tt::Q8_0;

float f16(const uint8_t* p) {
    uint16_t bits;
    std::memcpy(&bits, p, 2);
    return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// ggml's get_scale_min_k4: the j-th 6-bit scale and minimum of a Q4_K / Q5_K super-block
void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// One block of `type` at b into y (32 or 256 values), with ggml's formulas (dequantize_row_*)
void dequantize_block(int type, const uint8_t* b, float* y) {
    switch (type) {
    case Q4_0: {
        const float d = f16(b);
        for (int j = 0; j < 16; ++j) {
            y[j] = float((b[2 + j] & 0x0F) - 8) * d;
            y[j + 16] = float((b[2 + j] >> 4) - 8) * d;
        }
        break;
    }
    case Q5_0: {
        const float d = f16(b);
        uint32_t qh;
        std::memcpy(&qh, b + 2, 4);
        for (int j = 0; j < 16; ++j) {
            const int lo = (b[6 + j] & 0x0F) | (((qh >> j) << 4) & 0x10);
            const int hi = (b[6 + j] >> 4) | ((qh >> (j + 12)) & 0x10);
            y[j] = float(lo - 16) * d;
            y[j + 16] = float(hi - 16) * d;
        }
        break;
    }
    case Q8_0: {
        const float d = f16(b);
        for (int j = 0; j < 32; ++j) y[j] = float(int8_t(b[2 + j])) * d;
        break;
    }
    case Q4_K:
    case Q5_K: {
        const bool five = type == Q5_K;
        const float d = f16(b), dmin = f16(b + 2);
        const uint8_t* scales = b + 4;
        const uint8_t* qh = b + 16;                 // Q5_K only
        const uint8_t* q = b + (five ? 48 : 16);
        for (int c = 0, is = 0; c < 4; ++c, is += 2, q += 32) {
            int sc, m;
            scale_min_k4(is, scales, &sc, &m);
            const float d1 = d * float(sc), m1 = dmin * float(m);
            scale_min_k4(is + 1, scales, &sc, &m);
            const float d2 = d * float(sc), m2 = dmin * float(m);
            const uint8_t u1 = uint8_t(1 << (2 * c)), u2 = uint8_t(2 << (2 * c));
            for (int l = 0; l < 32; ++l) {
                const int h1 = five && (qh[l] & u1) ? 16 : 0, h2 = five && (qh[l] & u2) ? 16 : 0;
                y[64 * c + l] = d1 * float((q[l] & 0x0F) + h1) - m1;
                y[64 * c + 32 + l] = d2 * float((q[l] >> 4) + h2) - m2;
            }
        }
        break;
    }
    case Q6_K: {
        const float d = f16(b + 208);
        const uint8_t* ql = b;
        const uint8_t* qh = b + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
        for (int n = 0; n < 256; n += 128, ql += 64, qh += 32, sc += 8) {
            for (int l = 0; l < 32; ++l) {
                const int is = l / 16;
                const int q1 = int((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = int((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = int((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = int((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[n + l] = d * float(sc[is]) * float(q1);
                y[n + l + 32] = d * float(sc[is + 2]) * float(q2);
                y[n + l + 64] = d * float(sc[is + 4]) * float(q3);
                y[n + l + 96] = d * float(sc[is + 6]) * float(q4);
            }
        }
        break;
    }
    default:
        break;
    }
}

float dot(const float* a, const float* b, int64_t n) {
    float acc[16] = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
    for (; i < n; ++i) acc[i % 16] += a[i] * b[i];
    float s = 0.0f;
    for (float v : acc) s += v;
    return s;
}

// h [R, K] fp32; weight uint8 [N, row_bytes] (one GGUF matrix); ids int64 [R, C] rows of it.
// Returns [R, C]: out[r, c] = h[r] . dequantize(weight[ids[r, c]]).
at::Tensor gguf_rows_dot(const at::Tensor& h, const at::Tensor& weight, int64_t type, const at::Tensor& ids) {
    TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(), "h: contiguous fp32 [R, K]");
    TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.size(0) == h.size(0),
                "ids: contiguous int64 [R, C]");
    const int t = int(type);
    const int64_t R = h.size(0), C = ids.size(1), K = h.size(1), bw = block_weights(t), bb = block_bytes(t);
    TORCH_CHECK(bw > 0, "gguf_rows_dot: unsupported GGML type ", type);
    TORCH_CHECK(K % bw == 0, "gguf_rows_dot: K=", K, " is not a multiple of the block size ", bw);
    const int64_t row_bytes = K / bw * bb;
    TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() && weight.numel() % row_bytes == 0,
                "gguf_rows_dot: weight must be contiguous uint8 rows of ", row_bytes, " bytes");
    const int64_t N = weight.numel() / row_bytes;
    const int64_t* idp = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < R * C; ++i)
        TORCH_CHECK(idp[i] >= 0 && idp[i] < N, "gguf_rows_dot: row ", idp[i], " out of range [0, ", N, ")");
    at::Tensor out = at::empty({R, C}, h.options());
    const uint8_t* w = weight.data_ptr<uint8_t>();
    const float* hp = h.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, R * C, 8, [&](int64_t b, int64_t e) {
        std::vector<float> row(K);
        for (int64_t i = b; i < e; ++i) {
            const uint8_t* src = w + idp[i] * row_bytes;
            for (int64_t k = 0; k < K / bw; ++k) dequantize_block(t, src + k * bb, row.data() + k * bw);
            op[i] = dot(hp + (i / C) * K, row.data(), K);
        }
    });
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokentop, m) {
    m.def("gguf_rows_dot(Tensor h, Tensor weight, int type, Tensor ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokentop, CPU, m) { m.impl("gguf_rows_dot", &gguf_rows_dot); }
