// torch custom op tokentop::qmatmul: y = x W^T (+ bias) with W one or several raw GGUF matrices
// stacked along the output dimension (e.g. q|k|v). The activation rows are quantized once, then
// output rows are split over torch's intra-op threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <atomic>
#include <iterator>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <map>
#include <utility>
#include <vector>

#include "ops.h"
#include "qkernels.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

int env_isa() {
    static const int isa = [] {
        const int best = tt::best_isa();
        const char* s = std::getenv("TOKENTOP_KERNEL_ISA");
        if (!s || !*s || std::strcmp(s, "auto") == 0) return best;
        int want = std::strcmp(s, "scalar") == 0 ? tt::ISA_SCALAR
                 : std::strcmp(s, "avx2") == 0   ? tt::ISA_AVX2
                 : std::strcmp(s, "avx512") == 0 ? tt::ISA_AVX512 : best;
        return want < best ? want : best;
    }();
    return isa;
}

// v holds at least n elements (its contents are left as they are)
template <typename T>
void grow(std::vector<T>& v, int64_t n) {
    if (v.size() < size_t(n)) v.resize(size_t(n));
}

// f(b, e) over [0, n): each thread takes its static share front to back, a chunk at a time, and
// one done with its own takes the back half of what another has left, until nothing is left. A
// static split left the thread that finished first waiting at the region's end for the other
// (over a one-row decode one of two threads was busy 12-38% longer, from run to run, in the same
// kernels); the shares stay contiguous, so each thread still streams its weights in order. Each
// output row is computed alone: who computes it does not change a bit.
template <typename F>
void parallel_steal(int64_t n, int64_t grain, const F& f) {
    const int64_t T = std::min<int64_t>(at::get_num_threads(), n / std::max<int64_t>(grain, 1));
    if (T <= 1 || at::in_parallel_region()) {
        if (n > 0) f(0, n);
        return;
    }
    // per thread: what is left of its share, front in the low 32 bits, end in the high
    struct alignas(64) Share { std::atomic<uint64_t> left; };
    std::unique_ptr<Share[]> shares(new Share[size_t(T)]);
    auto pack = [](uint64_t b, uint64_t e) { return b | e << 32; };
    for (int64_t t = 0; t < T; ++t) shares[t].left.store(pack(uint64_t(n * t / T), uint64_t(n * (t + 1) / T)));
    // take up to `want(left)` units from the front (own share) or the back (another's)
    auto take = [&](Share& s, bool front, auto want, int64_t& b, int64_t& e) {
        uint64_t v = s.left.load(std::memory_order_relaxed);
        for (;;) {
            const int64_t lo = int64_t(v & 0xffffffffu), hi = int64_t(v >> 32), left = hi - lo;
            if (left <= 0) return false;
            const int64_t k = std::min(left, std::max(grain, want(left)));
            b = front ? lo : hi - k;
            e = front ? lo + k : hi;
            if (s.left.compare_exchange_weak(v, front ? pack(uint64_t(e), uint64_t(hi)) : pack(uint64_t(lo), uint64_t(b)),
                                             std::memory_order_relaxed))
                return true;
        }
    };
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
            int64_t b = 0, e = 0;
            // a quarter of what is left at a time: small chunks near the end, few in all
            while (take(shares[t], true, [](int64_t left) { return left / 4; }, b, e)) f(b, e);
            for (int64_t v = 1; v < T; ++v)
                while (take(shares[(t + v) % T], false, [](int64_t left) { return left / 2; }, b, e)) f(b, e);
        }
    });
}

// y + bias, in the activations' dtype
at::Tensor finish(at::Tensor& y, const std::optional<at::Tensor>& bias, at::ScalarType dtype) {
    if (bias.has_value()) y.add_(*bias);
    return dtype == at::kFloat ? y : y.to(dtype);
}

// A prefill output over glibc's largest mmap threshold (32 MiB, e.g. the 1.5B model's gate|up
// at 500 rows) is a fresh mapping every call, whose first touch page-faults through all of it
// (docs/kernels.md, 'Prefill: the AVX-512 panel kernel'). Such outputs reuse a pooled buffer
// once the caller has let go of it (the pool holds the only reference to its storage); smaller
// ones come from malloc's heap.
constexpr size_t POOL_MIN_BYTES = size_t(32) << 20;
constexpr size_t POOL_SIZE = 2;

at::Tensor pooled_output(int64_t M, int64_t N, const at::TensorOptions& opts) {
    static std::mutex mu;
    static std::vector<at::Tensor> pool;
    const bool inference = c10::InferenceMode::is_enabled();
    std::lock_guard<std::mutex> lock(mu);
    for (at::Tensor& t : pool) {
        if (t.storage().use_count() == 1 && t.is_inference() == inference && t.numel() >= M * N)
            return t.narrow(0, 0, M * N).view({M, N});
    }
    at::Tensor t = at::empty({M * N}, opts);
    if (pool.size() < POOL_SIZE) pool.push_back(t);
    else {                     // replace a free one (e.g. a smaller buffer), if any
        for (at::Tensor& p : pool)
            if (p.storage().use_count() == 1) { p = t; break; }
    }
    return t.view({M, N});
}

// Packed copies of the matrices (every GGUF type the op reads) for the AVX-512 panels (tt::pack_tiles; for the
// 32-wise types the bits of panels built from the GGUF blocks at every call, at a fraction of
// the cost; the K-quants sum a super-block in integers: qkernels.h). A
// matrix is packed on its first call of 2-32 rows (Q5_0, K-quants: 1-32) (engine/models/quant.py's pack_for_batches
// makes that call for every layer at load) and the copy lives as long as the matrix: the cache holds a weak reference to the
// matrix's storage, so a freed model's copies go at the next packing, and a new matrix at a
// reused address cannot match a stale entry (the storage object outlives its weak references).
// The matrices must not change in place (the engine's are the read-only mapped file).
// TOKENTOP_PACKED=0 turns them off (tt::use_packed).
// The copies are carved one after another out of slabs aligned to 2 MiB and advised for huge
// pages where transparent huge pages are on request (the usual "madvise" setting), as the mapped
// GGUF file is (engine/models/huge_pages.py): the calls stream the copies, and in 4 KiB pages the
// 1.5B's linear layers ran 1.08x slower at 1 row, 1.13x at 8 (docs/kernels.md, 'K-quants packed
// for one row'). One allocation a matrix, each padded to 2 MiB, held the 0.5B's many small
// matrices 0.24 GB more; advising only each copy's whole 2 MiB ranges left a third of the
// 1.5B's in small pages (0.83-0.98x). A slab goes when its last copy does. Guarded by packed_mu.
struct Slab {
    uint8_t* base;
    size_t size, used = 0;
    int64_t live = 0;
};
constexpr size_t HUGE_PAGE = size_t(2) << 20, SLAB_BYTES = size_t(64) << 20;
std::vector<Slab*> slabs;

void release(Slab* slab) {
    if (--slab->live > 0) return;
    std::free(slab->base);
    slabs.erase(std::find(slabs.begin(), slabs.end(), slab));
    delete slab;
}

struct SlabRelease {
    Slab* slab = nullptr;
    void operator()(uint8_t*) const { if (slab) release(slab); }
};

// n bytes (64-aligned) from the newest slab, or from a new one; nullptr when out of memory
std::unique_ptr<uint8_t, SlabRelease> slab_bytes(size_t n) {
    n = (n + 63) / 64 * 64;
    Slab* slab = slabs.empty() ? nullptr : slabs.back();
    if (!slab || slab->size - slab->used < n) {
        const size_t size = std::max(SLAB_BYTES, (n + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE);
        auto* base = static_cast<uint8_t*>(std::aligned_alloc(HUGE_PAGE, size));
        if (!base) return {nullptr, SlabRelease{}};
#if defined(__linux__) && defined(MADV_HUGEPAGE)
        madvise(base, size, MADV_HUGEPAGE);     // advice only: refused, the slab keeps small pages
#endif
        slab = new Slab{base, size};
        slabs.push_back(slab);
    }
    uint8_t* p = slab->base + slab->used;
    slab->used += n;
    ++slab->live;
    return {p, SlabRelease{slab}};
}

struct PackedCopy {
    c10::weak_intrusive_ptr<c10::StorageImpl> owner;
    int64_t type, rows, K;
    std::unique_ptr<uint8_t, SlabRelease> bytes{nullptr, SlabRelease{}};
};

std::mutex packed_mu;
// by (the matrix's first byte, its storage): two storages over the same bytes (e.g. two tensors
// made from one numpy array) have two copies, so a live copy is never replaced under a caller
std::map<std::pair<const void*, const c10::StorageImpl*>, PackedCopy> packed_cache;

const uint8_t* packed_matrix(const at::Tensor& w, int64_t type, int64_t rows, int64_t K) {
    std::lock_guard<std::mutex> lock(packed_mu);
    const auto key = std::make_pair(static_cast<const void*>(w.data_ptr()),
                                    static_cast<const c10::StorageImpl*>(w.storage().unsafeGetStorageImpl()));
    auto it = packed_cache.find(key);
    if (it != packed_cache.end() && !it->second.owner.expired() && it->second.type == type &&
        it->second.rows == rows && it->second.K == K)
        return it->second.bytes.get();
    for (auto e = packed_cache.begin(); e != packed_cache.end();) {     // the freed matrices' copies
        e = e->second.owner.expired() ? packed_cache.erase(e) : std::next(e);
    }
    // a live entry of another shape at the same bytes (a reinterpreted view): replaced below
    packed_cache.erase(key);
    const int64_t n = tt::packed_bytes(int(type), rows, K);
    PackedCopy copy{w.storage().getWeakStorageImpl(), type, rows, K};
    copy.bytes = slab_bytes(size_t(n));
    TORCH_CHECK(copy.bytes, "qmatmul: out of memory packing a ", rows, "x", K, " matrix (", n, " bytes)");
    const uint8_t* src = w.data_ptr<uint8_t>();
    uint8_t* dst = copy.bytes.get();
    at::parallel_for(0, (rows + 15) / 16, 4, [&](int64_t t0, int64_t t1) {
        tt::pack_tiles(int(type), src, rows, K, t0, t1, dst);
    });
    return packed_cache.emplace(key, std::move(copy)).first->second.bytes.get();
}

// Calls of more rows than tt::direct_max_rows take the panel kernel where the ISA has it (AVX-512,
// AVX2): from 5 rows on AVX2, from 2 on AVX-512 with the packed K-quants (tools/kernel_bench.py;
// docs/kernels.md, 'Panels built straight from the GGUF blocks', 'K-quants packed for the panels'),
// and on AVX-512 one-row calls of Q5_0, Q8_0 and K-quant matrices alone too, over their packed
// copies ('Q4_0, Q5_0 and Q8_0 packed too', 'K-quants packed for one row').
// The tiles are slower than both at every row count and serve only deterministic mode (and the
// portable path). The files behind each choice: the table atop qkernels.cpp.
//
// small_m: -1 the default, tt::direct_max_rows (calls of more rows amortize the panels' or
// tiles' unpacking over several activation rows); 0 never use the direct kernels (deterministic
// mode: then one kernel serves every row count, so a row's bits do not depend on its batch);
// k > 0: the direct kernels for calls of at most k rows (tests).
// big_m: -1 the panel kernel above direct_max_rows (or above a forced small_m), except with
// small_m=0 (deterministic mode keeps the tiles for every row count); 0 never; k > 0: from k
// rows (tests, benchmarks).
at::Tensor qmatmul(const at::Tensor& x_in, at::TensorList weights, at::IntArrayRef types,
                   at::IntArrayRef rows, const std::optional<at::Tensor>& bias, int64_t isa,
                   int64_t small_m, int64_t big_m) {
    TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16 ||
                                    x_in.scalar_type() == at::kHalf),
                "qmatmul: x must be 2-D float32, bfloat16 or float16");
    TORCH_CHECK(weights.size() == types.size() && types.size() == rows.size() && !weights.empty(),
                "qmatmul: weights, types and rows must have the same length");
    // bf16/fp16 activations are converted here and y returned in their dtype: one op call per
    // linear layer instead of three (a decode step makes ~100 short calls)
    const at::Tensor x = x_in.to(at::kFloat).contiguous();
    const int64_t M = x.size(0), K = x.size(1);
    TORCH_CHECK(K % 32 == 0, "qmatmul: K must be a multiple of 32");
    const int best = tt::best_isa();
    const int use = isa < 0 ? env_isa() : int(isa);
    TORCH_CHECK(use <= best, "qmatmul: ISA level ", use, " is not supported by this CPU (best ", best, ")");

    std::vector<int64_t> offset(weights.size() + 1, 0);
    for (size_t i = 0; i < weights.size(); ++i) {
        const int64_t bw = tt::block_weights(int(types[i]));
        TORCH_CHECK(bw > 0, "qmatmul: unsupported GGML type ", types[i]);
        TORCH_CHECK(K % bw == 0, "qmatmul: K=", K, " is not a multiple of the block size ", bw);
        const at::Tensor& w = weights[i];
        TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous(), "qmatmul: weights must be contiguous uint8");
        TORCH_CHECK(w.numel() == rows[i] * (K / bw) * tt::block_bytes(int(types[i])),
                    "qmatmul: weight ", i, " has ", w.numel(), " bytes, expected ", rows[i], " rows of K=", K);
        offset[i + 1] = offset[i] + rows[i];
    }
    const int64_t N = offset.back();
    // a forced small_m (k > 0) keeps the direct kernels up to k rows, panels or not
    const int64_t panel_rows = big_m >= 0 ? big_m : small_m == 0 ? 0 : std::max(tt::direct_max_rows(use), small_m) + 1;
    // by default a one-row call whose matrices are all Q5_0 or K-quants reads their packed copies
    bool one_row_packed = M == 1 && small_m < 0 && big_m < 0;
    for (int64_t t : types) one_row_packed = one_row_packed && tt::packed_one_row(use, int(t));
    const bool panels = (one_row_packed || (panel_rows > 0 && M >= panel_rows)) && tt::has_panels(use);
    at::Tensor y = panels && size_t(M) * size_t(N) * sizeof(float) >= POOL_MIN_BYTES
                       ? pooled_output(M, N, x.options()) : at::empty({M, N}, x.options());
    if (M == 0 || N == 0) return y.to(x_in.scalar_type());

    if (panels) {
        // the calling thread's buffers, grown as needed and never cleared: allocating and
        // zeroing them showed in every short decode call (docs/kernels.md, 'Per-thread
        // activation buffers')
        std::vector<const uint8_t*> packed(weights.size(), nullptr);
        for (size_t i = 0; i < weights.size() && M <= tt::packed_max_rows(); ++i)
            if (tt::has_packed(use, int(types[i]))) packed[i] = packed_matrix(weights[i], types[i], rows[i], K);
        // which activation forms the call reads: the panels' (32-wise) for built panels and the
        // packed Q4_0 / Q5_0 / Q8_0, the 256-wise one for the packed K-quants
        bool panel_form = false, k_form = false;
        for (size_t i = 0; i < weights.size(); ++i) {
            const bool packed_k = packed[i] && tt::is_k_quant(int(types[i]));
            k_form = k_form || packed_k;
            panel_form = panel_form || !packed_k;
        }
        thread_local std::vector<int8_t> a_buf, ak_buf;
        thread_local std::vector<float> d32_buf, as32_buf, dk_buf;
        thread_local std::vector<int32_t> is16_buf;
        if (panel_form) {
            grow(a_buf, M * K);
            grow(d32_buf, M * (K / 32));
            grow(as32_buf, M * (K / 32));
            grow(is16_buf, M * (K / 16));
            int8_t* const a = a_buf.data();
            float* const d32 = d32_buf.data();
            float* const as32 = as32_buf.data();
            int32_t* const is16 = is16_buf.data();
            at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
                tt::quantize_panel_rows(use, x.data_ptr<float>() + m0 * K, K, m1 - m0, K, a + m0 * K,
                                        d32 + m0 * (K / 32), as32 + m0 * (K / 32), is16 + m0 * (K / 16));
            });
        }
        if (k_form) {
            grow(ak_buf, M * K);
            grow(dk_buf, M * (K / 256));
            tt::DirectActs act;
            act.ak = ak_buf.data();
            act.dk = dk_buf.data();
            tt::quantize_direct(use, x.data_ptr<float>(), K, M, K, act);
        }
        // (plain pointers for the lambdas: a thread_local named there is the running thread's)
        const int8_t* const a = a_buf.data();
        const float* const d32 = d32_buf.data();
        const float* const as32 = as32_buf.data();
        const int32_t* const is16 = is16_buf.data();
        // the packed matrices' activations, once per type (kept per thread, as the buffers above)
        thread_local std::map<int64_t, tt::PackedActs> acts_buf;
        std::vector<const tt::PackedActs*> acts(weights.size(), nullptr);
        for (size_t i = 0; i < weights.size(); ++i) {
            if (!packed[i]) continue;
            tt::PackedActs& pa = acts_buf[types[i]];
            if (std::find(types.begin(), types.begin() + int64_t(i), types[i]) == types.begin() + int64_t(i))
                tt::prepare_packed(int(types[i]), K, a, d32, is16, ak_buf.data(), dk_buf.data(), M, pa);
            acts[i] = &pa;   // a type seen before in the stack: packed alike, prepared then
        }
        float* yp = y.data_ptr<float>();
        // threads take whole panels of output rows (of the stacked matrices): of packed copies,
        // as parallel_steal hands them out; panels built from the blocks (prefill, AVX2) in a
        // static split, where the chunks' restarts cost more than the balance saved (64- and
        // 500-row calls 1.04x and 1.02x slower, AVX2 8-row calls 1.08x)
        const int64_t P = tt::panel_rows(use);
        const bool all_packed = std::all_of(packed.begin(), packed.end(), [](const uint8_t* p) { return p != nullptr; });
        const auto split = [&](int64_t n, const auto& f) {
            if (all_packed) parallel_steal(n, 1, f);
            else at::parallel_for(0, n, 1, f);
        };
        split((N + P - 1) / P, [&](int64_t pb, int64_t pe) {
            const int64_t b = pb * P, e = std::min(pe * P, N);
            for (size_t i = 0; i < weights.size(); ++i) {
                const int64_t lo = std::max(b, offset[i]), hi = std::min(e, offset[i + 1]);
                if (lo >= hi) continue;
                if (packed[i]) {
                    tt::matmul_packed(int(types[i]), packed[i], rows[i], K, lo - offset[i], hi - offset[i], *acts[i],
                                      M, yp + offset[i], N);
                    continue;
                }
                tt::matmul_panels(use, int(types[i]), weights[i].data_ptr<uint8_t>(), K, lo - offset[i],
                                  hi - offset[i], a, d32, as32, is16, M, yp + offset[i], N);
            }
        });
        return finish(y, bias, x_in.scalar_type());
    }
    float* yp = y.data_ptr<float>();
    const int64_t direct_rows = small_m < 0 ? tt::direct_max_rows(use) : small_m;
    const bool direct = M <= direct_rows && tt::has_direct(use);
    if (direct) {
        // each type's form of the activations (qkernels.h), quantized once for the call
        bool k_types = false, w32_types = false;
        for (int64_t t : types) (tt::is_k_quant(int(t)) ? k_types : w32_types) = true;
        const bool avx512 = use == tt::ISA_AVX512;
        auto buf = [](auto& v, bool need, int64_t n) { if (need) grow(v, n); return need ? v.data() : nullptr; };
        thread_local std::vector<uint8_t> au;
        thread_local std::vector<int8_t> a, ak;
        thread_local std::vector<float> dl, d32, dk, as16k, as32k;
        thread_local std::vector<int32_t> ls;
        tt::DirectActs act;
        act.au = buf(au, w32_types && avx512, M * K);
        act.dl = buf(dl, w32_types && avx512, M * (K / 4));
        act.a = buf(a, w32_types && !avx512, M * K);
        act.d32 = buf(d32, w32_types && !avx512, M * (K / 32));
        act.ls = buf(ls, w32_types && !avx512, M * (K / 4));
        act.ak = buf(ak, k_types, M * K);
        act.dk = buf(dk, k_types, M * (K / 256));
        act.as16k = buf(as16k, k_types, M * (K / 16));
        act.as32k = buf(as32k, k_types, M * (K / 32));
        tt::quantize_direct(use, x.data_ptr<float>(), K, M, K, act);
        // chunks of >= 64 output rows: the per-chunk overhead stays small next to the row reads
        parallel_steal(N, 64, [&](int64_t b, int64_t e) {
            for (size_t i = 0; i < weights.size(); ++i) {
                const int64_t lo = std::max(b, offset[i]), hi = std::min(e, offset[i + 1]);
                if (lo >= hi) continue;
                tt::matmul_direct(use, int(types[i]), weights[i].data_ptr<uint8_t>(), K, lo - offset[i],
                                  hi - offset[i], act, M, yp + offset[i], N);
            }
        });
        return finish(y, bias, x_in.scalar_type());
    }
    std::vector<int8_t> a(M * K);
    std::vector<float> dl(M * (K / 4)), as16(M * (K / 16));
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
        tt::quantize_rows(x.data_ptr<float>() + m0 * K, K, m1 - m0, K, a.data() + m0 * K,
                          dl.data() + m0 * (K / 4), as16.data() + m0 * (K / 16));
    });
    // threads take whole tiles of 16 output rows (the AVX-512 kernel's unit of work)
    at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t tb, int64_t te) {
        const int64_t b = tb * 16, e = std::min(te * 16, N);
        for (size_t i = 0; i < weights.size(); ++i) {
            const int64_t lo = std::max(b, offset[i]), hi = std::min(e, offset[i + 1]);
            if (lo >= hi) continue;
            tt::matmul_rows(use, int(types[i]), weights[i].data_ptr<uint8_t>(), K, lo - offset[i],
                            hi - offset[i], a.data(), dl.data(), as16.data(), M, yp + offset[i], N);
        }
    });
    return finish(y, bias, x_in.scalar_type());
}

int64_t best_isa_op() { return tt::best_isa(); }
int64_t env_isa_op() { return env_isa(); }
// rows up to which the default ISA's (or `isa`'s) calls take the direct kernels (0: it has none)
int64_t direct_rows_op(int64_t isa) { return tt::direct_max_rows(isa < 0 ? env_isa() : int(isa)); }
// the fewest rows for which the default ISA's calls take the kernel of batches and prefill
// (the panels on AVX-512 and AVX2, the portable row kernel elsewhere): what the load-time
// self-check runs it with
int64_t batch_rows_op() { return tt::direct_max_rows(env_isa()) + 1; }

// the fewest rows (up to 8) for which the default ISA's Q8_0 calls take the row-lane kernel
// (0: none): the self-check runs that form too
int64_t lane_rows_op() { return tt::lane_min_rows(env_isa()); }

// whether a one-row call of `type` alone reads its packed copy on the default ISA (Q5_0; the
// K-quants where transparent huge pages can be had)
bool one_row_packed_op(int64_t type) { return tt::packed_one_row(env_isa(), int(type)); }

// whether the AVX2 panels take AVX-VNNI's vpdpbusd (the CPU has it, TOKENTOP_AVX_VNNI is not 0)
bool avx_vnni_op() { return tt::use_avx_vnni(); }

// bytes held by the packed copies (freed matrices' included until the next packing)
int64_t packed_bytes_op() {
    std::lock_guard<std::mutex> lock(packed_mu);
    int64_t total = 0;
    for (const auto& [key, copy] : packed_cache) total += tt::packed_bytes(int(copy.type), copy.rows, copy.K);
    return total;
}

}  // namespace

namespace tt::ops {

at::Tensor qmatmul(const at::Tensor& x, at::TensorList weights, at::IntArrayRef types, at::IntArrayRef rows,
                   const std::optional<at::Tensor>& bias, int64_t isa, int64_t small_m, int64_t big_m) {
    return ::qmatmul(x, weights, types, rows, bias, isa, small_m, big_m);
}

}  // namespace tt::ops

TORCH_LIBRARY(tokentop, m) {
    m.def("qmatmul(Tensor x, Tensor[] weights, int[] types, int[] rows, Tensor? bias, int isa=-1, "
          "int small_m=-1, int big_m=-1) -> Tensor");
    m.def("best_isa() -> int", &best_isa_op);
    m.def("env_isa() -> int", &env_isa_op);
    m.def("direct_rows(int isa=-1) -> int", &direct_rows_op);
    m.def("batch_rows() -> int", &batch_rows_op);
    m.def("lane_rows() -> int", &lane_rows_op);
    m.def("one_row_packed(int type) -> bool", &one_row_packed_op);
    m.def("avx_vnni() -> bool", &avx_vnni_op);
    m.def("packed_bytes() -> int", &packed_bytes_op);
}

TORCH_LIBRARY_IMPL(tokentop, CPU, m) { m.impl("qmatmul", &qmatmul); }
