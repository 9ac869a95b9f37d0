// Batch-invariant attention for x86 CPUs with AVX2 and FMA (see `invariant_attention` in
// specdecode/models/int8.py).
//
// Inputs: query [heads, n, d], key and value [kv_heads, length, d], float32, d a multiple of 8; each head's
// keys and values contiguous rows of d, the heads at any stride (a view of a longer, preallocated cache);
// query head h reads key head h / (heads / kv_heads). Row i sees keys 0 .. prefix[i] - 1, then the keys
// indices[offsets[i] .. offsets[i + 1] - 1] (sorted, all >= prefix[i]): its visible keys, in that order.
// Output [heads, n, d]: softmax(scale q k^T) v over each row's visible keys.
//
// Each (row, head) is computed by one thread, from its query, its visible keys and values in order and the
// scale alone, never from n, the other rows or the threads: its visible keys go in blocks of kBlock by
// logical index (block j holds visible keys j kBlock .. j kBlock + kBlock - 1); each score is a dot product
// over d in a fixed order (8 lanes, then the lanes summed in a fixed order), then an online softmax per
// block: new max m' = max(m, block max), sum and accumulator rescaled by exp(m - m'), then exp(s - m')
// and exp(s - m') v added key by key in order; out = accumulator / sum. The exponential is our own
// (Cephes' polynomial), so no library decides its rounding.
// For cache efficiency a thread takes a run of (kv head, row) pairs and, within a kv head, loops blocks
// outer and rows inner: a block of keys several rows see (rows of one forward share the cache) is read
// from memory once for all of them, and once for the query heads that share the key head.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;  // visible keys per online-softmax step
constexpr int kHeadTile = 4;    // query heads whose dot products share each loaded key chunk

// e^x, lane by lane (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-5 polynomial for e^r, times 2^n);
// relative error ~1e-7; inputs below -87.3 give ~0, never NaN
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365447504019f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n, split in two factors so that n = 128 (x near 88.4) does not overflow the exponent field
  const __m256i e = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(e, 1);
  const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
  const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(e, half), _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}

inline float exp1(float x) { return _mm256_cvtss_f32(exp256(_mm256_set1_ps(x))); }

// the 8 lanes summed in a fixed order
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// scores[g][k0 + k] = scale * q_g . key_{k0 + k} for G query heads and K keys at once: each loaded chunk of a
// key or a query feeds several products (one load per product made the loop load-bound). Every product keeps
// its own accumulator, chunks added in order of e, so the tiling changes no bit of any score.
template <int G, int K>
inline void dot_tile(const float* const* queries, const float* const* keys, int64_t k0, int64_t d, float scale,
                     float (*scores)[kBlock]) {
  __m256 acc[G][K];
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < K; ++k) acc[g][k] = _mm256_setzero_ps();
  for (int64_t e = 0; e < d; e += 8) {
    __m256 key[K];
    for (int k = 0; k < K; ++k) key[k] = _mm256_loadu_ps(keys[k0 + k] + e);
    for (int g = 0; g < G; ++g) {
      const __m256 q = _mm256_loadu_ps(queries[g] + e);
      for (int k = 0; k < K; ++k) acc[g][k] = _mm256_fmadd_ps(q, key[k], acc[g][k]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < K; ++k) scores[g][k0 + k] = hsum(acc[g][k]) * scale;
}

// scores[g][k] = scale * q_g . key_k for G query heads (G <= kHeadTile) and `count` keys; K keys a tile
// (G K accumulators, K keys and a query: at most 16 vector registers)
template <int G>
void dot_block(const float* const* queries, const float* const* keys, int64_t count, int64_t d, float scale,
               float (*scores)[kBlock]) {
  constexpr int K = G >= 3 ? 3 : 4;
  int64_t k = 0;
  for (; k + K <= count; k += K) dot_tile<G, K>(queries, keys, k, d, scale, scores);
  for (; k < count; ++k) dot_tile<G, 1>(queries, keys, k, d, scale, scores);
}

void dot_heads(const float* const* queries, int heads, const float* const* keys, int64_t count, int64_t d,
               float scale, float (*scores)[kBlock]) {
  for (int g = 0; g < heads; g += kHeadTile) {
    switch (std::min(kHeadTile, heads - g)) {
      case 1: dot_block<1>(queries + g, keys, count, d, scale, scores + g); break;
      case 2: dot_block<2>(queries + g, keys, count, d, scale, scores + g); break;
      case 3: dot_block<3>(queries + g, keys, count, d, scale, scores + g); break;
      default: dot_block<4>(queries + g, keys, count, d, scale, scores + g); break;
    }
  }
}

// One head's online softmax over one block: its running max, its sum and its accumulator [d]
struct State {
  float max, sum;
  float* acc;  // [d]
};

// The block's scores [count] (with room to kBlock) become exp(score - new max) in place; the state's max and
// sum move on; returns the factor the accumulator is rescaled by before the block's values are added
float softmax_exp(State& state, float* scores, int64_t count) {
  float block_max = scores[0];
  for (int64_t k = 1; k < count; ++k) block_max = std::max(block_max, scores[k]);
  const float new_max = std::max(state.max, block_max);
  const float correction = state.sum > 0.0f ? exp1(state.max - new_max) : 0.0f;  // nothing to rescale before
  for (int64_t k = count; k < (count + 7) / 8 * 8; ++k) scores[k] = -std::numeric_limits<float>::infinity();
  __m256 total = _mm256_setzero_ps();
  const __m256 shift = _mm256_set1_ps(new_max);
  for (int64_t k = 0; k < count; k += 8) {  // the padding lanes' exp is 0
    const __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + k), shift));
    _mm256_storeu_ps(scores + k, p);
    total = _mm256_add_ps(total, p);
  }
  state.sum = state.sum * correction + hsum(total);
  state.max = new_max;
  return correction;
}

// acc_h = correction_h acc_h + sum over the block's keys, in order, of p_h[k] value_k, for H heads that share
// the values (each chunk of a value loaded once for all of them), W chunks of 8 dimensions at a time
template <int H, int W>
inline void add_values(State* const* states, const float* corrections, float* const* probs,
                       const float* const* values, int64_t count, int64_t e) {
  __m256 acc[H][W];
  for (int h = 0; h < H; ++h) {
    const __m256 c = _mm256_set1_ps(corrections[h]);
    for (int w = 0; w < W; ++w) acc[h][w] = _mm256_mul_ps(_mm256_loadu_ps(states[h]->acc + e + 8 * w), c);
  }
  for (int64_t k = 0; k < count; ++k) {
    __m256 v[W];
    for (int w = 0; w < W; ++w) v[w] = _mm256_loadu_ps(values[k] + e + 8 * w);
    for (int h = 0; h < H; ++h) {
      const __m256 p = _mm256_set1_ps(probs[h][k]);
      for (int w = 0; w < W; ++w) acc[h][w] = _mm256_fmadd_ps(p, v[w], acc[h][w]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(states[h]->acc + e + 8 * w, acc[h][w]);
}

// One block for a row's `group` query heads: scores (from dot_heads) to probabilities, then the values added,
// heads in pairs
void softmax_block(State* states, int group, float (*scores)[kBlock], const float* const* values, int64_t count,
                   int64_t d) {
  float corrections[2];
  State* pair[2];
  float* probs[2];
  for (int g = 0; g < group; g += 2) {
    const int h = std::min(2, group - g);
    for (int i = 0; i < h; ++i) {
      corrections[i] = softmax_exp(states[g + i], scores[g + i], count);
      pair[i] = &states[g + i];
      probs[i] = scores[g + i];
    }
    int64_t e = 0;
    if (h == 2) {
      for (; e + 32 <= d; e += 32) add_values<2, 4>(pair, corrections, probs, values, count, e);
      for (; e < d; e += 8) add_values<2, 1>(pair, corrections, probs, values, count, e);
    } else {
      for (; e + 32 <= d; e += 32) add_values<1, 4>(pair, corrections, probs, values, count, e);
      for (; e < d; e += 8) add_values<1, 1>(pair, corrections, probs, values, count, e);
    }
  }
}

at::Tensor attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale_,
                     const at::Tensor& prefix, const at::Tensor& offsets, const at::Tensor& indices) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3, "attention: query [heads, n, d], key and value [kv_heads, length, d]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat,
              "attention: float32 tensors");
  const int64_t heads = query.size(0), n = query.size(1), d = query.size(2);
  const int64_t kv_heads = key.size(0), length = key.size(1);
  TORCH_CHECK(d % 8 == 0 && key.size(2) == d && value.sizes() == key.sizes(), "attention: d a multiple of 8, shapes agree");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "attention: heads a multiple of kv_heads");
  TORCH_CHECK(prefix.numel() == n && offsets.numel() == n + 1, "attention: prefix [n] and offsets [n + 1]");
  // a head's keys must be contiguous rows; the heads may lie anywhere (a cache grown in place is a view)
  auto rows_of = [d](const at::Tensor& t) { return t.stride(2) == 1 && t.stride(1) == d ? t : t.contiguous(); };
  const at::Tensor q = query.contiguous(), k_ = rows_of(key), v_ = rows_of(value);
  const int64_t k_head = k_.stride(0), v_head = v_.stride(0);
  const at::Tensor pre = prefix.to(at::kLong).contiguous(), off = offsets.to(at::kLong).contiguous(),
                   idx = indices.to(at::kLong).contiguous();
  const int64_t* pp = pre.data_ptr<int64_t>();
  const int64_t* op = off.data_ptr<int64_t>();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(pp[i] >= 0 && pp[i] <= length && op[i] <= op[i + 1], "attention: bad visible keys of row ", i);
    for (int64_t j = op[i]; j < op[i + 1]; ++j) TORCH_CHECK(ip[j] >= pp[i] && ip[j] < length, "attention: bad extra key of row ", i);
  }
  const int group = static_cast<int>(heads / kv_heads);
  const float scale = static_cast<float>(scale_);
  at::Tensor out = at::empty({heads, n, d}, query.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_.data_ptr<float>();
  const float* vp = v_.data_ptr<float>();
  float* outp = out.data_ptr<float>();

  // task t = (kv head t / n, row t % n); a thread's run of tasks is split by kv head
  at::parallel_for(0, kv_heads * n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> accs;
    std::vector<State> states;
    std::vector<const float*> queries(group), keys(kBlock), values(kBlock);
    std::vector<float> score_rows(static_cast<size_t>(group) * kBlock);
    auto scores = reinterpret_cast<float (*)[kBlock]>(score_rows.data());
    for (int64_t t = begin; t < end;) {
      const int64_t kv = t / n, r0 = t % n, r1 = std::min(n, r0 + (end - t));  // rows r0 .. r1 - 1 of kv head kv
      t += r1 - r0;
      const int64_t rows = r1 - r0;
      accs.assign(static_cast<size_t>(rows * group * d), 0.0f);
      states.resize(rows * group);
      int64_t most = 0;
      for (int64_t r = 0; r < rows; ++r) {
        most = std::max(most, pp[r0 + r] + op[r0 + r + 1] - op[r0 + r]);
        for (int g = 0; g < group; ++g)
          states[r * group + g] = {-std::numeric_limits<float>::infinity(), 0.0f, accs.data() + (r * group + g) * d};
      }
      const float* kbase = kp + kv * k_head;
      const float* vbase = vp + kv * v_head;
      for (int64_t start = 0; start < most; start += kBlock) {  // blocks outer: rows reading one block share it
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = r0 + r, p = pp[i], seen = p + op[i + 1] - op[i];
          if (start >= seen) continue;
          const int64_t count = std::min(kBlock, seen - start);
          for (int64_t k = 0; k < count; ++k) {
            const int64_t j = start + k, at = j < p ? j : ip[op[i] + j - p];
            keys[k] = kbase + at * d;
            values[k] = vbase + at * d;
          }
          for (int g = 0; g < group; ++g) queries[g] = qp + ((kv * group + g) * n + i) * d;
          dot_heads(queries.data(), group, keys.data(), count, d, scale, scores);
          softmax_block(states.data() + r * group, group, scores, values.data(), count, d);
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int g = 0; g < group; ++g) {
          const State& s = states[r * group + g];
          float* o = outp + ((kv * group + g) * n + r0 + r) * d;
          for (int64_t e = 0; e < d; ++e) o[e] = s.sum > 0.0f ? s.acc[e] / s.sum : 0.0f;  // seeing nothing: zeros
        }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(specdecode_attention, m) {
  m.def("attention(Tensor query, Tensor key, Tensor value, float scale, Tensor prefix, Tensor offsets, Tensor indices) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode_attention, CPU, m) { m.impl("attention", &attention); }
