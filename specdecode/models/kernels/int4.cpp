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
// One row takes the channels one at a time (weight bandwidth bounds it). Several rows go in tiles of up to
// 8 rows, each met by a group of 2 or 4 channels: each channel's pair of blocks is unpacked once and each
// row's activations loaded once for the whole group, the group x tile sums accumulating in registers
// (multiply-adds bound it). With many rows (a prompt's prefill) AVX-512 VNNI unpacks each channel's
// weights once into int8 panels that every tile of rows then reads, instead of unpacking them again for
// each tile (`unpack_panel`); the 256-bit variants gain nothing from it and keep the tiles.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int kRowTile = 8;      // rows sharing one unpacked weight block
constexpr int64_t kChannelTile = 16;  // channels per task of at::parallel_for
constexpr int64_t kPrefetch = 4096;  // bytes ahead: one core alone streams weights ~25% faster with it
constexpr int64_t kGroupPrefetchL1 = 16384;  // most bytes of k * (channels + rows) that prefetch into L1 (of 32 KB)

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

// sums[c * R + r] = sum_k w8[c, k] u[r, k] for C consecutive channels and R rows. Weights come in pairs
// of blocks: 32 bytes whose low halves are the first block's 32 nibbles and whose high halves are the
// second's. Each pair is unpacked once per channel and each row's activations loaded once per pair for all
// C channels, so C x R accumulators stay in registers. Three variants give the same exact int32 sums,
// bitwise, by different instructions: AVX2 (u8 x s8 pairs to int16, then to int32: three instructions
// per 32 products and row), AVX-VNNI (one instruction per 32) and AVX-512 VNNI (one per 64).
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

// One channel streams its own weights, prefetched ahead; a group of C channels reads C places of memory at
// once, which the hardware prefetcher follows poorly, so the group prefetches the next group in memory
// order, 32 C bytes a step: all of it into L1 where it fits beside this group and the R rows, else into L2.
template <int C>
__attribute__((always_inline)) inline __m256i load_group_pair(const uint8_t* nibbles, int64_t p) {
  if (C == 1) return load_pair(nibbles, p);
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles + 32 * p));
}

template <int C, int R>
__attribute__((always_inline)) inline void prefetch_next_group(const uint8_t* nibbles, int64_t k, int64_t p) {
  if (C == 1) return;
  const char* next = reinterpret_cast<const char*>(nibbles + C * (k / 2) + 32 * C * p);
  if (k * (C + R) <= kGroupPrefetchL1)
    for (int c = 0; c < C; c += 2) _mm_prefetch(next + 32 * c, _MM_HINT_T0);
  else
    for (int c = 0; c < C; c += 2) _mm_prefetch(next + 32 * c, _MM_HINT_T1);
}

// sums[i] = the sum of acc[i]'s lanes, for N accumulators (hadd pairs, then the two 128-bit halves)
template <int N>
inline void reduce(const __m256i* acc, int32_t* sums) {
  if (N == 1) {
    sums[0] = hsum(acc[0]);
    return;
  }
  for (int i0 = 0; i0 < N; i0 += 8) {
    __m256i v[8];
    for (int j = 0; j < 8; ++j) v[j] = i0 + j < N ? acc[i0 + j] : _mm256_setzero_si256();
    const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    alignas(32) int32_t out[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(out),
                       _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31)));
    for (int j = 0; j < 8 && i0 + j < N; ++j) sums[i0 + j] = out[j];
  }
}

template <int C, int R>
void dot_tile_avx2(const uint8_t* nibbles, const uint8_t* groups, const uint8_t* u, int64_t k, int32_t* sums) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[C * R];
  for (int i = 0; i < C * R; ++i) acc[i] = _mm256_setzero_si256();
  for (int64_t p = 0; p < k / (2 * kBlock); ++p) {
    __m256i w0[C], w1[C];
    for (int c = 0; c < C; ++c) {
      const __m256i raw = load_group_pair<C>(nibbles + c * (k / 2), p);
      w0[c] = unpack_first(groups + c * (k / kBlock), p, raw);
      w1[c] = unpack_second(groups + c * (k / kBlock), p, raw);
    }
    prefetch_next_group<C, R>(nibbles, k, p);
    for (int r = 0; r < R; ++r) {
      const uint8_t* a = u + r * k + 2 * kBlock * p;
      const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
      const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + kBlock));
      for (int c = 0; c < C; ++c) {
        const __m256i p0 = _mm256_maddubs_epi16(a0, w0[c]), p1 = _mm256_maddubs_epi16(a1, w1[c]);
        acc[c * R + r] = _mm256_add_epi32(acc[c * R + r], _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones)));
      }
    }
  }
  reduce<C * R>(acc, sums);
}

template <int C, int R>
__attribute__((target("avx2,fma,avxvnni")))
void dot_tile_avxvnni(const uint8_t* nibbles, const uint8_t* groups, const uint8_t* u, int64_t k, int32_t* sums) {
  __m256i acc[C * R];
  for (int i = 0; i < C * R; ++i) acc[i] = _mm256_setzero_si256();
  for (int64_t p = 0; p < k / (2 * kBlock); ++p) {
    __m256i w0[C], w1[C];
    for (int c = 0; c < C; ++c) {
      const __m256i raw = load_group_pair<C>(nibbles + c * (k / 2), p);
      w0[c] = unpack_first(groups + c * (k / kBlock), p, raw);
      w1[c] = unpack_second(groups + c * (k / kBlock), p, raw);
    }
    prefetch_next_group<C, R>(nibbles, k, p);
    for (int r = 0; r < R; ++r) {
      const uint8_t* a = u + r * k + 2 * kBlock * p;
      const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
      const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + kBlock));
      for (int c = 0; c < C; ++c) {
        acc[c * R + r] = _mm256_dpbusd_avx_epi32(acc[c * R + r], a0, w0[c]);
        acc[c * R + r] = _mm256_dpbusd_avx_epi32(acc[c * R + r], a1, w1[c]);
      }
    }
  }
  reduce<C * R>(acc, sums);
}

// sums[i] = the sum of acc[i]'s lanes, for N accumulators: sixteen at a time fold into one vector (halves
// of pairs, then quarters of pairs, then 32-bit and 64-bit interleaves), which leaves v[4e + l]'s sum in
// element 4l + e, hence the transposed order they are taken in
template <int N>
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vnni")))
inline void reduce(const __m512i* acc, int32_t* sums) {
  if (N == 1) {
    sums[0] = _mm512_reduce_add_epi32(acc[0]);
    return;
  }
  for (int i0 = 0; i0 < N; i0 += 16) {
    __m512i v[16];
    for (int j = 0; j < 16; ++j) {
      const int i = i0 + 4 * (j % 4) + j / 4;
      v[j] = i < N ? acc[i] : _mm512_setzero_si512();
    }
    __m512i x[8], y[4];
    for (int j = 0; j < 8; ++j)
      x[j] = _mm512_add_epi32(_mm512_shuffle_i64x2(v[2 * j], v[2 * j + 1], 0x44), _mm512_shuffle_i64x2(v[2 * j], v[2 * j + 1], 0xEE));
    for (int j = 0; j < 4; ++j)
      y[j] = _mm512_add_epi32(_mm512_shuffle_i64x2(x[2 * j], x[2 * j + 1], 0x88), _mm512_shuffle_i64x2(x[2 * j], x[2 * j + 1], 0xDD));
    const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(y[0], y[1]), _mm512_unpackhi_epi32(y[0], y[1]));
    const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(y[2], y[3]), _mm512_unpackhi_epi32(y[2], y[3]));
    const __m512i total = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
    const int left = N - i0;
    _mm512_mask_storeu_epi32(sums + i0, left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1), total);
  }
}

template <int C, int R>
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vnni")))
void dot_tile_avx512vnni(const uint8_t* nibbles, const uint8_t* groups, const uint8_t* u, int64_t k, int32_t* sums) {
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  __m512i acc[C * R];
  for (int i = 0; i < C * R; ++i) acc[i] = _mm512_setzero_si512();
  for (int64_t p = 0; p < k / (2 * kBlock); ++p) {
    __m512i w[C];
    for (int c = 0; c < C; ++c) {
      const uint8_t* g = groups + c * (k / kBlock);
      const __m256i raw = load_group_pair<C>(nibbles + c * (k / 2), p);
      // the pair's 64 nibbles in the activations' order: the first block's (low halves), then the second's
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1);
      // 128-bit lanes 0-1 look up the first block's table, lanes 2-3 the second's
      const __m512i tables = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kTables.bytes[g[2 * p]])))),
          _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kTables.bytes[g[2 * p + 1]]))), 1);
      w[c] = _mm512_shuffle_epi8(tables, _mm512_and_si512(both, low_mask));
    }
    prefetch_next_group<C, R>(nibbles, k, p);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_loadu_si512(u + r * k + 2 * kBlock * p);
      for (int c = 0; c < C; ++c) acc[c * R + r] = _mm512_dpbusd_epi32(acc[c * R + r], a, w[c]);
    }
  }
  reduce<C * R>(acc, sums);
}

// Many rows: C channels' weights unpacked once into an int8 panel, which every tile of rows then reads as it
// reads the activations (`dot_tile_*` unpacks them again for each tile). panel[(p * C + c) * 64 + j] is
// channel c's weight for input 64 p + j (the activations' order: a pair's first block, then its second).
inline void unpack_panel(const uint8_t* nibbles, const uint8_t* groups, int64_t nib_stride, int64_t group_stride,
                         int64_t k, int C, int8_t* panel) {
  for (int c = 0; c < C; ++c)
    for (int64_t p = 0; p < k / (2 * kBlock); ++p) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles + c * nib_stride + 32 * p));
      int8_t* out = panel + (p * C + c) * 2 * kBlock;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), unpack_first(groups + c * group_stride, p, raw));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + kBlock), unpack_second(groups + c * group_stride, p, raw));
    }
}

using PanelFn = void (*)(const int8_t*, const uint8_t*, int64_t, int32_t*);

// sums[r * C + c] = sum_k panel's w8[c, k] u[r, k], for C channels of a panel and R rows (row-major: a row's
// C sums side by side, as its outputs lie)
template <int C, int R>
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vnni")))
void panel_dot_avx512vnni(const int8_t* panel, const uint8_t* u, int64_t k, int32_t* sums) {
  __m512i acc[C * R];
  for (int i = 0; i < C * R; ++i) acc[i] = _mm512_setzero_si512();
  for (int64_t p = 0; p < k / (2 * kBlock); ++p) {
    __m512i w[C];
    for (int c = 0; c < C; ++c) w[c] = _mm512_loadu_si512(panel + (p * C + c) * 2 * kBlock);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_loadu_si512(u + r * k + 2 * kBlock * p);
      for (int c = 0; c < C; ++c) acc[r * C + c] = _mm512_dpbusd_epi32(acc[r * C + c], a, w[c]);
    }
  }
  reduce<C * R>(acc, sums);
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

// A variant's functions: fns[0][R - 1] takes one channel and R rows (the one-row call's only function, and
// the channels a group leaves over), fns[1][R - 1] `channels[0]` channels at a time for R <= split rows,
// fns[2][R - 1] `channels[1]` for more (fewer channels leave registers for the accumulators of more rows).
// Calls with several rows take them in tiles of at most kRowTile.
struct Tiling {
  int split, channels[2];
  DotFn fns[3][kRowTile];
};

template <template <int, int> class Dot, int C, int R, int Low, int High>
constexpr DotFn entry() {
  if constexpr (R >= Low && R <= High) return Dot<C, R>::f;
  else return nullptr;
}

template <template <int, int> class Dot, int C, int Low, int High>
constexpr std::array<DotFn, kRowTile> row_fns() {
  return {entry<Dot, C, 1, Low, High>(), entry<Dot, C, 2, Low, High>(), entry<Dot, C, 3, Low, High>(), entry<Dot, C, 4, Low, High>(),
          entry<Dot, C, 5, Low, High>(), entry<Dot, C, 6, Low, High>(), entry<Dot, C, 7, Low, High>(), entry<Dot, C, 8, Low, High>()};
}

// tiles of a call hold R or R - 1 rows: a group of channels that takes up to `Split` rows also takes one fewer
template <template <int, int> class Dot, int Split, int Few, int Many>
Tiling tiling() {
  static_assert(Few <= 4 && Many <= 4, "int4_linear keeps at most 4 x kRowTile sums");
  Tiling t{Split, {Few, Many}, {}};
  const auto one = row_fns<Dot, 1, 1, kRowTile>(), few = row_fns<Dot, Few, 1, Split>(), many = row_fns<Dot, Many, Split, kRowTile>();
  std::copy(one.begin(), one.end(), t.fns[0]);
  std::copy(few.begin(), few.end(), t.fns[1]);
  std::copy(many.begin(), many.end(), t.fns[2]);
  return t;
}

template <int C, int R> struct Avx2Dot { static constexpr DotFn f = dot_tile_avx2<C, R>; };
template <int C, int R> struct AvxVnniDot { static constexpr DotFn f = dot_tile_avxvnni<C, R>; };
template <int C, int R> struct Avx512VnniDot { static constexpr DotFn f = dot_tile_avx512vnni<C, R>; };

const Tiling& tiling_of(int64_t kernel) {
  static const Tiling avx2 = tiling<Avx2Dot, kRowTile, 2, 2>(), avxvnni = tiling<AvxVnniDot, kRowTile, 2, 2>(),
                      avx512vnni = tiling<Avx512VnniDot, 6, 4, 2>();
  switch (kernel) {
    case kAvxVnni: return avxvnni;
    case kAvx512Vnni: return avx512vnni;
    default: return avx2;
  }
}

// The panel functions: kPanelFns[0][R - 1] one channel and R rows (the channels a panel of kPanelChannels
// leaves over), kPanelFns[1][R - 1] kPanelChannels channels (24 accumulators of 32 registers at 6 rows)
constexpr int kPanelChannels = 4, kPanelRows = 6;
template <int C>
constexpr std::array<PanelFn, kPanelRows> panel_fns() {
  return {panel_dot_avx512vnni<C, 1>, panel_dot_avx512vnni<C, 2>, panel_dot_avx512vnni<C, 3>,
          panel_dot_avx512vnni<C, 4>, panel_dot_avx512vnni<C, 5>, panel_dot_avx512vnni<C, 6>};
}
const std::array<PanelFn, kPanelRows> kPanelFns[2] = {panel_fns<1>(), panel_fns<kPanelChannels>()};

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& groups,
                       const at::Tensor& scales, const at::Tensor& weight_sums, const c10::optional<at::Tensor>& bias,
                       int64_t kernel, int64_t panel_from) {
  if (kernel < 0) kernel = best_kernel();
  TORCH_CHECK(supported(kernel), "int4_linear: this CPU lacks the instructions of kernel ", kernel);
  const Tiling& tiles_of = tiling_of(kernel);
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
  auto rescale = [&](const int32_t* sums, int64_t c0, int channels, int64_t r0, int rows) {
    for (int c = 0; c < channels; ++c)
      for (int r = 0; r < rows; ++r) {
        const int64_t ch = c0 + c;
        float y = sp[ch] * (stepp[r0 + r] * static_cast<float>(sums[c * rows + r]) + lowp[r0 + r] * wsp[ch]);
        op[(r0 + r) * n + ch] = bp ? y + bp[ch] : y;
      }
  };
  const int64_t nib_stride = padded / 2, group_stride = padded / kBlock;
  if (m == 1) {
    const DotFn dot = tiles_of.fns[0][0];
    const int64_t tiles = (n + kChannelTile - 1) / kChannelTile;
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      int32_t sums[1];
      for (int64_t c = begin * kChannelTile; c < std::min(n, end * kChannelTile); ++c) {
        dot(np + c * nib_stride, gp + c * group_stride, up, padded, sums);
        rescale(sums, c, 1, 0, 1);
      }
    });
    return out;
  }
  if (kernel == kAvx512Vnni && m >= panel_from) {  // many rows: unpacked panels (`unpack_panel`)
    constexpr int C = kPanelChannels;
    static_assert(C == 4, "the panels' rescaling takes four channels at a time");
    const int64_t row_tiles = (m + kPanelRows - 1) / kPanelRows;
    const int64_t channel_tile = C * std::max<int64_t>(1, kChannelTile / C);
    const int64_t tiles = (n + channel_tile - 1) / channel_tile;
    // a task's channels are unpacked first, panel by panel; then each tile of rows meets all its panels while
    // its activations are in cache
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      std::vector<int8_t> unpacked(channel_tile * padded);
      int32_t sums[4 * kRowTile];
      for (int64_t c0 = begin * channel_tile; c0 < std::min(n, end * channel_tile); c0 += channel_tile) {
        const int64_t c1 = std::min(n, c0 + channel_tile);
        for (int64_t c = c0; c < c1;) {
          const int channels = c1 - c >= C ? C : 1;
          unpack_panel(np + c * nib_stride, gp + c * group_stride, nib_stride, group_stride, padded, channels,
                       unpacked.data() + (c - c0) * padded);
          c += channels;
        }
        for (int64_t t = 0; t < row_tiles; ++t) {
          const int64_t r0 = t * m / row_tiles;
          const int rows = static_cast<int>((t + 1) * m / row_tiles - r0);
          for (int64_t c = c0; c < c1;) {
            const int channels = c1 - c >= C ? C : 1;
            kPanelFns[channels == C][rows - 1](unpacked.data() + (c - c0) * padded, up + r0 * padded, padded, sums);
            if (channels == 1) {
              rescale(sums, c, 1, r0, rows);  // (one channel: its sums in row order either way)
              c += channels;
              continue;
            }
            // `rescale`'s operations, four channels at a time (the panels' sums are row-major): each lane does
            // the scalar operations in their order (no fused multiply-adds), so each output is bitwise the same
            const __m128 scale = _mm_loadu_ps(sp + c), wsum = _mm_loadu_ps(wsp + c);
            for (int r = 0; r < rows; ++r) {
              const __m128 sum = _mm_cvtepi32_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sums + r * C)));
              __m128 y = _mm_mul_ps(scale, _mm_add_ps(_mm_mul_ps(_mm_set1_ps(stepp[r0 + r]), sum),
                                                      _mm_mul_ps(_mm_set1_ps(lowp[r0 + r]), wsum)));
              if (bp) y = _mm_add_ps(y, _mm_loadu_ps(bp + c));
              _mm_storeu_ps(op + (r0 + r) * n + c, y);
            }
            c += channels;
          }
        }
      }
    });
    return out;
  }
  // rows in equal tiles; each group of channels meets every row tile while its weights are in cache
  const int64_t row_tiles = (m + kRowTile - 1) / kRowTile;
  const int largest = static_cast<int>((m + row_tiles - 1) / row_tiles);  // the others hold as many or one fewer
  const int group = largest <= tiles_of.split ? 1 : 2, C = tiles_of.channels[group - 1];
  const int64_t channel_tile = C * std::max<int64_t>(1, kChannelTile / C);
  const int64_t tiles = (n + channel_tile - 1) / channel_tile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    int32_t sums[4 * kRowTile];
    for (int64_t c = begin * channel_tile; c < std::min(n, end * channel_tile);) {
      const int channels = n - c >= C ? C : 1;
      for (int64_t t = 0; t < row_tiles; ++t) {
        const int64_t r0 = t * m / row_tiles;
        const int rows = static_cast<int>((t + 1) * m / row_tiles - r0);
        tiles_of.fns[channels == C ? group : 0][rows - 1](np + c * nib_stride, gp + c * group_stride, up + r0 * padded, padded, sums);
        rescale(sums, c, channels, r0, rows);
      }
      c += channels;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(specdecode_int4, m) {
  // kernel: 0 AVX2, 1 AVX-VNNI, 2 AVX-512 VNNI, -1 the best this CPU has (all give the same output);
  // panel_from: the rows from which AVX-512 VNNI reads unpacked panels (the same output again)
  m.def("linear(Tensor x, Tensor nibbles, Tensor groups, Tensor scales, Tensor weight_sums, Tensor? bias, int kernel=-1, int panel_from=48) -> Tensor");
  m.def("supported(int kernel) -> bool", &supported);
}

TORCH_LIBRARY_IMPL(specdecode_int4, CPU, m) { m.impl("linear", &int4_linear); }
