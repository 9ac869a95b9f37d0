// Batch-invariant 4-bit x 7-bit linear layer for x86 CPUs with AVX2, AVX-VNNI or AVX-512 VNNI (see
// specdecode/models/int4.py).
//
// Weights: w[n, k] = scale[n] * group[n, k / 32] * (nibble[n, k] - 8), group in 1..15, nibbles packed
// two to a byte per pair of blocks of 32 (byte j of a pair's 32 holds element j of the first block in its
// low half, element j of the second in its high half); in_features padded to a multiple of 64. group * (nibble - 8) lies in [-120, 105]: an int8, looked up with one byte shuffle per block.
// Activations: each row on its own, x ~ low + step * u with u in 0..127 (7 bits keep the pairwise sums
// of AVX2's u8 x s8 product inside int16).
// Output: y[m, n] = scale[n] * (step[m] * sum_k w8[n, k] u[m, k] + low[m] * sum_k w8[n, k]) + bias[n].
// The sum is exact int32 arithmetic, so its order does not matter and a row's output is bitwise the
// same whatever other rows the call carries.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kBlock = 32;
constexpr int kRowTile = 8;      // rows sharing one unpacked weight block
constexpr int64_t kChannelTile = 16;  // channels whose weights stay in cache while every row tile passes
constexpr int64_t kPrefetch = 4096;  // bytes ahead: one core alone streams weights ~25% faster with it

// tables[g] maps a nibble to g * (nibble - 8)
struct Tables {
  alignas(16) int8_t bytes[16][16];
  Tables() {
    for (int g = 0; g < 16; ++g)
      for (int q = 0; q < 16; ++q) bytes[g][q] = static_cast<int8_t>(g * (q - 8));
  }
};
const Tables kTables;

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// One row onto 0..127: u = round((x - low) * 127 / (high - low)); a constant row is all zeros, step 0.
void quantize_row(const float* x, int64_t k, uint8_t* u, float* low_out, float* step_out) {
  __m256 lo = _mm256_loadu_ps(x), hi = lo;
  for (int64_t i = 8; i < k; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    lo = _mm256_min_ps(lo, v);
    hi = _mm256_max_ps(hi, v);
  }
  alignas(32) float los[8], his[8];
  _mm256_store_ps(los, lo);
  _mm256_store_ps(his, hi);
  float low = los[0], high = his[0];
  for (int i = 1; i < 8; ++i) {
    low = std::min(low, los[i]);
    high = std::max(high, his[i]);
  }
  const float range = high - low;
  *low_out = low;
  *step_out = range / 127.0f;
  if (!(range > 0.0f)) {
    std::fill(u, u + k, 0);
    return;
  }
  const __m256 inv = _mm256_set1_ps(127.0f / range), base = _mm256_set1_ps(low);
  const __m256i top = _mm256_set1_epi32(127), zero = _mm256_setzero_si256();
  for (int64_t i = 0; i < k; i += 32) {
    __m256i q[4];
    for (int j = 0; j < 4; ++j) {
      __m256 v = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8 * j), base), inv);
      q[j] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(v), zero), top);  // round to nearest even
    }
    // int32 -> int16 -> uint8 packs interleave 128-bit lanes; the permute puts them back in order
    __m256i packed = _mm256_packus_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(u + i), packed);
  }
}

// sums[r] = sum_k w8[k] u[r, k] for one channel and R rows. Weights come in pairs of blocks: 32 bytes
// whose low halves are the first block's 32 nibbles and whose high halves are the second's. Three
// variants give the same exact int32 sums, bitwise, by different instructions: AVX2 (u8 x s8 pairs to
// int16, then to int32: three instructions per 32 products and row), AVX-VNNI (one instruction per 32)
// and AVX-512 VNNI (one per 64).
inline __m256i unpack_first(const uint8_t* groups, int64_t p, __m256i raw) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kTables.bytes[groups[2 * p]])));
  return _mm256_shuffle_epi8(table, _mm256_and_si256(raw, _mm256_set1_epi8(0x0F)));
}

inline __m256i unpack_second(const uint8_t* groups, int64_t p, __m256i raw) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kTables.bytes[groups[2 * p + 1]])));
  return _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F)));
}

inline __m256i load_pair(const uint8_t* nibbles, int64_t p) {
  _mm_prefetch(reinterpret_cast<const char*>(nibbles + 32 * p + kPrefetch), _MM_HINT_T0);  // a hint: no fault
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles + 32 * p));
}

template <int R>
void dot_rows_avx2(const uint8_t* nibbles, const uint8_t* groups, const uint8_t* u, int64_t k, int32_t* sums) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
  for (int64_t p = 0; p < k / (2 * kBlock); ++p) {
    const __m256i raw = load_pair(nibbles, p);
    const __m256i w0 = unpack_first(groups, p, raw), w1 = unpack_second(groups, p, raw);
    for (int r = 0; r < R; ++r) {
      const uint8_t* a = u + r * k + 2 * kBlock * p;
      const __m256i p0 = _mm256_maddubs_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)), w0);
      const __m256i p1 = _mm256_maddubs_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + kBlock)), w1);
      acc[r] = _mm256_add_epi32(acc[r], _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones)));
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = hsum(acc[r]);
}

template <int R>
__attribute__((target("avx2,fma,avxvnni")))
void dot_rows_avxvnni(const uint8_t* nibbles, const uint8_t* groups, const uint8_t* u, int64_t k, int32_t* sums) {
  __m256i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
  for (int64_t p = 0; p < k / (2 * kBlock); ++p) {
    const __m256i raw = load_pair(nibbles, p);
    const __m256i w0 = unpack_first(groups, p, raw), w1 = unpack_second(groups, p, raw);
    for (int r = 0; r < R; ++r) {
      const uint8_t* a = u + r * k + 2 * kBlock * p;
      acc[r] = _mm256_dpbusd_avx_epi32(acc[r], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)), w0);
      acc[r] = _mm256_dpbusd_avx_epi32(acc[r], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + kBlock)), w1);
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = hsum(acc[r]);
}

template <int R>
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vnni")))
void dot_rows_avx512vnni(const uint8_t* nibbles, const uint8_t* groups, const uint8_t* u, int64_t k, int32_t* sums) {
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  __m512i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
  for (int64_t p = 0; p < k / (2 * kBlock); ++p) {
    const __m256i raw = load_pair(nibbles, p);
    // the pair's 64 nibbles in the activations' order: the first block's (low halves), then the second's
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1);
    // 128-bit lanes 0-1 look up the first block's table, lanes 2-3 the second's
    const __m512i tables = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kTables.bytes[groups[2 * p]])))),
        _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kTables.bytes[groups[2 * p + 1]]))), 1);
    const __m512i w = _mm512_shuffle_epi8(tables, _mm512_and_si512(both, low_mask));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_loadu_si512(u + r * k + 2 * kBlock * p), w);
  }
  for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_epi32(acc[r]);
}

enum Kernel : int64_t { kAvx2 = 0, kAvxVnni = 1, kAvx512Vnni = 2 };

bool supported(int64_t kernel) {
  __builtin_cpu_init();
  switch (kernel) {
    case kAvx2: return __builtin_cpu_supports("avx2");
    case kAvxVnni: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avxvnni");
    case kAvx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
    default: return false;
  }
}

int64_t best_kernel() {
  static const int64_t best = supported(kAvx512Vnni) ? kAvx512Vnni : supported(kAvxVnni) ? kAvxVnni : kAvx2;
  return best;
}

using DotFn = void (*)(const uint8_t*, const uint8_t*, const uint8_t*, int64_t, int32_t*);

template <template <int> class Rows>
struct Table {
  static constexpr DotFn fns[kRowTile] = {Rows<1>::f, Rows<2>::f, Rows<3>::f, Rows<4>::f,
                                         Rows<5>::f, Rows<6>::f, Rows<7>::f, Rows<8>::f};
};

template <int R> struct Avx2Rows { static constexpr DotFn f = dot_rows_avx2<R>; };
template <int R> struct AvxVnniRows { static constexpr DotFn f = dot_rows_avxvnni<R>; };
template <int R> struct Avx512VnniRows { static constexpr DotFn f = dot_rows_avx512vnni<R>; };

// fns[kernel][rows - 1]
const DotFn* dot_functions(int64_t kernel) {
  switch (kernel) {
    case kAvxVnni: return Table<AvxVnniRows>::fns;
    case kAvx512Vnni: return Table<Avx512VnniRows>::fns;
    default: return Table<Avx2Rows>::fns;
  }
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& groups,
                       const at::Tensor& scales, const at::Tensor& weight_sums, const c10::optional<at::Tensor>& bias,
                       int64_t kernel) {
  if (kernel < 0) kernel = best_kernel();
  TORCH_CHECK(supported(kernel), "int4_linear: this CPU lacks the instructions of kernel ", kernel);
  const DotFn* dots = dot_functions(kernel);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int4_linear: x must be float32 [m, k]");
  const int64_t m = x.size(0), k = x.size(1), n = nibbles.size(0);
  const int64_t padded = 2 * nibbles.size(1);  // in_features rounded up to whole pairs of blocks
  TORCH_CHECK(k % kBlock == 0 && padded % (2 * kBlock) == 0 && padded >= k && padded - k < 2 * kBlock,
              "int4_linear: in_features must be a multiple of 32 and match the weights");
  TORCH_CHECK(groups.size(0) == n && groups.size(1) == padded / kBlock && scales.size(0) == n,
              "int4_linear: weight shape mismatch");
  const at::Tensor input = x.contiguous();
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  at::Tensor u = at::zeros({m, padded}, x.options().dtype(at::kByte));  // the padding stays 0
  at::Tensor low = at::empty({m}, x.options()), step = at::empty({m}, x.options());
  const float* xp = input.data_ptr<float>();
  uint8_t* up = u.data_ptr<uint8_t>();
  float *lowp = low.data_ptr<float>(), *stepp = step.data_ptr<float>();
  at::parallel_for(0, m, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(xp + r * k, k, up + r * padded, lowp + r, stepp + r);
  });
  const uint8_t *np = nibbles.data_ptr<uint8_t>(), *gp = groups.data_ptr<uint8_t>();
  const float *sp = scales.data_ptr<float>(), *wsp = weight_sums.data_ptr<float>();
  const float* bp = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t tiles = (n + kChannelTile - 1) / kChannelTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    int32_t sums[kRowTile];
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t c0 = tile * kChannelTile, c1 = std::min(n, c0 + kChannelTile);
      for (int64_t r0 = 0; r0 < m; r0 += kRowTile) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowTile, m - r0));
        for (int64_t c = c0; c < c1; ++c) {
          dots[rows - 1](np + c * (padded / 2), gp + c * (padded / kBlock), up + r0 * padded, padded, sums);
          for (int r = 0; r < rows; ++r) {
            float y = sp[c] * (stepp[r0 + r] * static_cast<float>(sums[r]) + lowp[r0 + r] * wsp[c]);
            op[(r0 + r) * n + c] = bp ? y + bp[c] : y;
          }
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(specdecode_int4, m) {
  // kernel: 0 AVX2, 1 AVX-VNNI, 2 AVX-512 VNNI, -1 the best this CPU has (all give the same output)
  m.def("linear(Tensor x, Tensor nibbles, Tensor groups, Tensor scales, Tensor weight_sums, Tensor? bias, int kernel=-1) -> Tensor");
  m.def("supported(int kernel) -> bool", &supported);
}

TORCH_LIBRARY_IMPL(specdecode_int4, CPU, m) { m.impl("linear", &int4_linear); }
