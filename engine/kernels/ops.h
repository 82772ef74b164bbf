// The tokentop ops as C++ functions, for code that chains them without going back to Python
// (decode_layers.cpp). Each is the function the op registers: same checks, same numbers.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace tt::ops {

at::Tensor qmatmul(const at::Tensor& x, at::TensorList weights, at::IntArrayRef types, at::IntArrayRef rows,
                   const std::optional<at::Tensor>& bias, int64_t isa, int64_t small_m, int64_t big_m);
at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& delta, const at::Tensor& w, double eps);
at::Tensor act_mul(const at::Tensor& gate_up, int64_t act);
at::Tensor rope_store_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         const c10::optional<at::Tensor>& qk_norm, double eps, double q_scale, int64_t n_heads,
                         int64_t n_kv, bool interleaved, at::Tensor k_store, at::Tensor v_store,
                         const at::Tensor& slots);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_store, const at::Tensor& v_store,
                            const at::Tensor& slots, const at::Tensor& lengths, double softcap);

}  // namespace tt::ops
