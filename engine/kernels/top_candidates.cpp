// tokentop::top_candidates: the indices of each row's k largest logits, for the decoder's
// refinement of the top candidates (engine/models/decoder.py _refine).
//
// In torch (decoder.top_candidates: chunk maxima, topk of those, a gather and a topk) it took
// ~45 us a row on one thread and ~360 us for 8 rows, as much as the rest of the sampler. Here one
// pass takes the maximum of each chunk of 64 logits (vec_math.h's max_of, 16 lanes on AVX-512);
// the k chunks with the largest maxima hold the k largest values, and a k-entry heap keeps the
// largest of those chunks' values. Rows are computed each on its own,
// so a row's candidates do not depend on the batch.
//
// Order: value descending, then index ascending (ties at the k-th place go to the lowest index
// among the chunks searched, as topk's set is exact only up to ties). NaN ranks below every number (max_of never lets a NaN lane win): the row's sampler
// flags a NaN row anyway.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "vec_math.h"

namespace {

constexpr int64_t CHUNK = 64;

// out[c] = the max of x's chunk c (the last chunk may be short)
template <typename F>
TT_INLINE void chunk_maxima_w(const float* x, int64_t V, float* out) {
    for (int64_t c0 = 0, c = 0; c0 < V; c0 += CHUNK, ++c) out[c] = max_of<F>(x, c0, std::min(V, c0 + CHUNK));
}
TT_BY_WIDTH(chunk_maxima, (const float* x, int64_t V, float* out), (x, V, out))
using ChunkMaxima = decltype(chunk_maxima_for(0));

using Entry = std::pair<float, int64_t>;   // (value, index), NaN stored as -inf

// a ranks before b: larger value first, then the lower index
inline bool ranks_before(const Entry& a, const Entry& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// Keeps the k best entries offered in ascending index order. An entry equal in value to the
// worst kept comes later, so it ranks after it: one comparison with `worst` rejects nearly all.
struct Best {
    std::vector<Entry> heap;   // heap.front() is the worst kept
    size_t k;
    float worst = -std::numeric_limits<float>::infinity();
    explicit Best(size_t k_) : k(k_) { heap.reserve(k_); }
    void offer(float v, int64_t i) {
        if (heap.size() == k && !(v > worst)) return;               // a NaN too
        if (v != v) v = -std::numeric_limits<float>::infinity();   // NaN ranks last
        if (heap.size() < k) {
            heap.emplace_back(v, i);
            std::push_heap(heap.begin(), heap.end(), ranks_before);
        } else {
            std::pop_heap(heap.begin(), heap.end(), ranks_before);
            heap.back() = {v, i};
            std::push_heap(heap.begin(), heap.end(), ranks_before);
        }
        if (heap.size() == k) worst = heap.front().first;
    }
};

// scratch: at least 2 * chunks(V) floats
void top_row(ChunkMaxima chunk_maxima, const float* x, int64_t V, int64_t k, float* scratch, int64_t* out) {
    const float ninf = -std::numeric_limits<float>::infinity();
    const int64_t n_chunks = (V + CHUNK - 1) / CHUNK;
    float* maxima = scratch;   // never NaN: max_of skips NaN lanes (an all-NaN chunk gives -inf)
    chunk_maxima(x, V, maxima);
    // the k-th largest chunk maximum, and the chunks above it, then those at it by index
    float floor = ninf;
    std::vector<int64_t> picked;
    if (n_chunks <= k) {
        for (int64_t c = 0; c < n_chunks; ++c) picked.push_back(c);
    } else {
        float* sorted = scratch + n_chunks;
        std::copy(maxima, maxima + n_chunks, sorted);
        std::nth_element(sorted, sorted + k - 1, sorted + n_chunks, std::greater<float>());
        floor = sorted[k - 1];
        for (int64_t c = 0; c < n_chunks; ++c)
            if (maxima[c] > floor) picked.push_back(c);
        for (int64_t c = 0; c < n_chunks && int64_t(picked.size()) < k; ++c)
            if (maxima[c] == floor) picked.push_back(c);
        std::sort(picked.begin(), picked.end());   // values offered in ascending index order
    }
    // the k chosen chunks' maxima are k values >= floor, so the k largest values all reach it:
    // only those are offered (all where it is -inf, e.g. a row of NaN)
    Best values{size_t(k)};
    for (int64_t c : picked)
        for (int64_t i = c * CHUNK; i < std::min(V, (c + 1) * CHUNK); ++i)
            if (floor == ninf || x[i] >= floor) values.offer(x[i], i);
    std::sort(values.heap.begin(), values.heap.end(), ranks_before);
    for (int64_t j = 0; j < k; ++j) out[j] = values.heap[j].second;
}

// logits [R, V] fp32 -> int64 [R, k], 1 <= k <= V
at::Tensor top_candidates(const at::Tensor& logits, int64_t k) {
    TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                    logits.dim() == 2,
                "logits must be a contiguous fp32 CPU tensor [R, V]");
    const int64_t R = logits.size(0), V = logits.size(1);
    TORCH_CHECK(k >= 1 && k <= V, "k=", k, " outside [1, ", V, "]");
    at::Tensor out = at::empty({R, k}, logits.options().dtype(at::kLong));
    const float* x = logits.data_ptr<float>();
    int64_t* op = out.data_ptr<int64_t>();
    const ChunkMaxima maxima = chunk_maxima_for(simd_level());
    auto rows = [&](int64_t r0, int64_t r1) {
        std::vector<float> scratch(2 * ((V + CHUNK - 1) / CHUNK));
        for (int64_t r = r0; r < r1; ++r) top_row(maxima, x + r * V, V, k, scratch.data(), op + r * k);
    };
    if (R == 1) rows(0, 1);   // one row: waking the pool costs more than the row
    else at::parallel_for(0, R, 1, rows);
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokentop, m) { m.def("top_candidates(Tensor logits, int k) -> Tensor"); }

TORCH_LIBRARY_IMPL(tokentop, CPU, m) { m.impl("top_candidates", &top_candidates); }
