// Prefill tiles of bf16 attention as two small matrix products on AVX512-BF16 CPUs.
//
// Included by paged_attention.cpp, whose work items it serves when a tile has several query
// tokens (a prefill chunk) in bf16; decode rows keep that file's vector path. Per item (one
// sequence, up to kQTile query tokens, one KV head and the `group` query heads sharing it):
//   1. the sequence's keys are rearranged from their pages into blocks of 16 keys, once per KV
//      head for all of its tiles (paged_attention.cpp's rearrange_prefill_keys; each tile had
//      rearranged the keys it sees, which for a causal prompt is quadratic in its length):
//      K transposed into bf16 pairs of head_dim ([d/2][16 keys][2]), V interleaved by token
//      pairs ([8 pairs][d][2]), the layouts VDPBF16PS multiplies (tokens past the end are 0);
//   2. S = Q K^T: each instruction takes one bf16 pair of 12 query rows' head dims against 16
//      keys, 64 FLOP, so a row block of 12 keeps the two FMA pipes busy;
//   3. an exact fp32 softmax per row (causal limit per row), its unnormalised weights rounded
//      to bf16 as torch's own bf16 attention rounds them before P V;
//   4. O = P V: each instruction adds two tokens' weights times 16 head dims for one row.
// The vector path scored eight keys per transpose-and-add tree in 8-lane vectors and widened
// V to fp32 (~130-180 GFLOP/s on 2 Zen 5 cores); see paged_attention.cpp for the measured gain.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PDSERVE_TILE_BF16 1
#include <immintrin.h>

#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace pdserve {

constexpr int64_t kKeyBlock = 16;  // keys per block: one fp32 lane each in a score vector

// Per-thread buffers, grown to the largest item a thread has taken and then reused; kt and vi
// hold one (sequence, KV head)'s keys, rearranged once for all of its tiles (paged_attention.cpp's
// rearrange_prefill_keys), the rest one item's products.
struct TileScratch {
  std::vector<uint32_t> kt;   // [blocks][d/2][16]: key pairs of head dims, transposed
  std::vector<uint16_t> vi;   // [blocks][8][d][2]: values interleaved by token pairs
  std::vector<float> scores;  // [rows][blocks * 16]
  std::vector<uint16_t> probs;  // [rows][blocks * 16], bf16 bits; zero past each row's limit
  std::vector<float> inv_sum;   // [rows]
};

inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// scores[r][block b] = q_r . k (unscaled: softmax_row scales) for R rows and blocks [0, num_blocks): per head-dim
// pair, one load of 16 keys' pair serves all R rows (each row's pair is a 32-bit broadcast).
template <int D, int R>
void score_rows(const uint32_t* const* q, const uint32_t* kt, int64_t num_blocks, float* scores, int64_t row_len) {
  constexpr int NP = D / 2;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint32_t* kb = kt + b * NP * kKeyBlock;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int i = 0; i < NP; ++i) {
      const __m512i k = _mm512_loadu_si512(kb + i * kKeyBlock);
      for (int r = 0; r < R; ++r) acc[r] = dot_pairs(acc[r], _mm512_set1_epi32(static_cast<int>(q[r][i])), k);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(scores + r * row_len + b * kKeyBlock, acc[r]);
  }
}

// acc[r] = sum_t p[r][t] v_t over blocks [0, num_blocks) for R rows (NV vectors of 16 head dims
// each), two tokens per instruction; hands each row's vectors to store(r, c, acc[r][c]).
template <int D, int R, typename Store>
void accumulate_rows(const uint16_t* probs, int64_t row_len, const uint16_t* vi, int64_t num_blocks, Store&& store) {
  constexpr int NV = D / 16;
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int j = 0; j < kKeyBlock / 2; ++j) {
      const uint16_t* pair = vi + (b * (kKeyBlock / 2) + j) * 2 * D;
      __m512i v[NV];
      for (int c = 0; c < NV; ++c) v[c] = _mm512_loadu_si512(pair + 32 * c);
      for (int r = 0; r < R; ++r) {
        uint32_t w;
        std::memcpy(&w, probs + r * row_len + b * kKeyBlock + 2 * j, sizeof(w));
        const __m512i p = _mm512_set1_epi32(static_cast<int>(w));
        for (int c = 0; c < NV; ++c) acc[r][c] = dot_pairs(acc[r][c], p, v[c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) store(r, c, acc[r][c]);
}

// Rows per accumulate_rows call: R rows x D/16 vectors of accumulators fill 24 registers.
template <int D>
constexpr int kValueRowsFor = std::max(1, 24 / (D / 16));

// Calls f(std::integral_constant<int, R>) for a runtime R in [1, kMax] (the row-block tails).
template <int kMax, typename F>
void with_rows(int64_t r, F&& f) {
  if constexpr (kMax >= 1) {
    if (r == kMax) return f(std::integral_constant<int, kMax>{});
    with_rows<kMax - 1>(r, f);
  }
}

// 16-key blocks covering `context` keys, in whole 32-key steps (AMX's P V tile takes 32 keys):
// how many blocks rearrange_keys writes for a sequence's whole context.
inline int64_t key_blocks_32(int64_t context) { return ((context + 31) / 32) * 2; }

// Step 1: the keys [0, kv_end) of one KV head into `kt` and `vi` (see the file comment), zeros
// past kv_end up to num_blocks.
template <int D>
void rearrange_keys(const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, const int32_t* pages,
                    int64_t page_size, int64_t tok_stride, int64_t head_offset, int64_t kv_end,
                    int64_t num_blocks, TileScratch& s) {
  constexpr int NP = D / 2, NV = D / 16;
  s.kt.resize(num_blocks * NP * kKeyBlock);
  s.vi.resize(num_blocks * kKeyBlock * D);
  static const uint16_t zeros[D] = {};
  // Interleave two tokens' 16 head dims: lanes (x, x + 32) -> 2x, 2x + 1.
  alignas(64) static const uint16_t interleave[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i idx = _mm512_load_si512(interleave);
  auto row = [&](const c10::BFloat16* cache, int64_t t) -> const uint16_t* {
    if (t >= kv_end) return zeros;
    const int64_t page = pages[t / page_size];
    return reinterpret_cast<const uint16_t*>(cache + (page * page_size + t % page_size) * tok_stride + head_offset);
  };
  for (int64_t b = 0; b < num_blocks; ++b) {
    uint32_t* kb = s.kt.data() + b * NP * kKeyBlock;
    for (int j = 0; j < kKeyBlock; ++j) {
      uint32_t pairs[NP];
      std::memcpy(pairs, row(k_cache, b * kKeyBlock + j), sizeof(pairs));
      for (int i = 0; i < NP; ++i) kb[i * kKeyBlock + j] = pairs[i];
    }
    for (int j = 0; j < kKeyBlock / 2; ++j) {
      const uint16_t* v0 = row(v_cache, b * kKeyBlock + 2 * j);
      const uint16_t* v1 = row(v_cache, b * kKeyBlock + 2 * j + 1);
      uint16_t* dst = s.vi.data() + (b * (kKeyBlock / 2) + j) * 2 * D;
      for (int c = 0; c < NV; ++c) {
        const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + 16 * c)));
        const __m512i x = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + 16 * c)));
        _mm512_storeu_si512(dst + 32 * c, _mm512_permutex2var_epi16(a, idx, x));
      }
    }
  }
}

// Step 3 for one row: softmax weights of its `limit` visible scores, each times `scale` (> 0:
// the max of the raw scores is the max of the scaled ones), as bf16 into `probs`, zeros up to
// the row's end (`row_len`); returns 1 / their fp32 sum.
inline float softmax_row(const float* scores, int64_t limit, int64_t row_len, float scale, uint16_t* probs) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  auto visible = [&](int64_t t) -> __mmask16 {
    const int64_t n = limit - t;
    return n >= 16 ? static_cast<__mmask16>(0xFFFF) : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
  };
  __m512 mv = neg_inf;
  for (int64_t t = 0; t < limit; t += 16) mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(neg_inf, visible(t), scores + t));
  const __m512 sc = _mm512_set1_ps(scale);
  const __m512 m_sc = _mm512_set1_ps(_mm512_reduce_max_ps(mv) * scale);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < row_len; t += 16) {
    const __mmask16 mask = visible(t);
    // s scale - m scale in one fused multiply-subtract (one rounding, not two).
    const __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(mask, scores + t), sc, m_sc);
    const __m512 e = _mm512_maskz_mov_ps(mask, exp16(x));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + t), (__m256i)_mm512_cvtneps_pbh(e));
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

// One work item: query tokens [q_first, q_first + n_q) of q (row stride q_tok_stride, head
// stride q_head_stride), their `group` heads sharing KV head `kv_head`; query i sees keys
// [0, limit0 + i), which `keys` holds rearranged (at least that far: keys past a row's limit
// get zero weight). out has the query's layout ([tokens][heads][D]).
template <int D>
void attend_tile_bf16(const c10::BFloat16* q, int64_t q_tok_stride, int64_t q_head_stride, int64_t q_first,
                      int64_t n_q, int64_t group, int64_t kv_head, int64_t limit0, const TileScratch& keys,
                      int64_t kv_heads, c10::BFloat16* out, float scale, TileScratch& s) {
  constexpr int kScoreRows = 12;  // 12 accumulators cover VDPBF16PS's latency on both pipes
  constexpr int kValueRows = kValueRowsFor<D>;
  const int64_t rows = n_q * group;
  const int64_t kv_end = limit0 + n_q - 1;
  const int64_t num_blocks = (kv_end + kKeyBlock - 1) / kKeyBlock;
  const int64_t row_len = num_blocks * kKeyBlock;
  s.scores.resize(rows * row_len);
  s.probs.resize(rows * row_len);
  s.inv_sum.resize(rows);
  const int64_t heads = kv_heads * group;
  // Row r = (query r / group, head kv_head * group + r % group); its limit grows with r / group.
  auto limit = [&](int64_t r) { return limit0 + r / group; };
  auto blocks_seen = [&](int64_t last_row) { return (limit(last_row) + kKeyBlock - 1) / kKeyBlock; };

  for (int64_t r0 = 0; r0 < rows; r0 += kScoreRows) {
    const int64_t n = std::min<int64_t>(kScoreRows, rows - r0);
    const uint32_t* q_rows[kScoreRows];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = r0 + i;
      q_rows[i] = reinterpret_cast<const uint32_t*>(q + (q_first + r / group) * q_tok_stride +
                                                    (kv_head * group + r % group) * q_head_stride);
    }
    with_rows<kScoreRows>(n, [&](auto R) {
      score_rows<D, decltype(R)::value>(q_rows, keys.kt.data(), blocks_seen(r0 + n - 1), s.scores.data() + r0 * row_len,
                                        row_len);
    });
  }
  for (int64_t r = 0; r < rows; ++r)
    s.inv_sum[r] = softmax_row(s.scores.data() + r * row_len, limit(r), row_len, scale, s.probs.data() + r * row_len);
  for (int64_t r0 = 0; r0 < rows; r0 += kValueRows) {
    const int64_t n = std::min<int64_t>(kValueRows, rows - r0);
    c10::BFloat16* out_rows[kValueRows];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = r0 + i;
      out_rows[i] = out + ((q_first + r / group) * heads + kv_head * group + r % group) * D;
    }
    // out_r = acc_r / (the row's sum of weights), in bf16.
    auto store = [&](int r, int c, __m512 acc) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_rows[r] + 16 * c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc, _mm512_set1_ps(s.inv_sum[r0 + r]))));
    };
    with_rows<kValueRows>(n, [&](auto R) {
      accumulate_rows<D, decltype(R)::value>(s.probs.data() + r0 * row_len, row_len, keys.vi.data(),
                                             blocks_seen(r0 + n - 1), store);
    });
  }
}

}  // namespace pdserve

#else
#define PDSERVE_TILE_BF16 0
#endif
