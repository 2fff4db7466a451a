// Decode tokens whose sequences share cached prefix pages, attended together: on AMX tiles
// where the CPU has them, else with AVX512-BF16 dot products.
//
// Included by paged_attention.cpp, which finds the groups: decode tokens (one query token each)
// whose page tables begin with the same pages, as prefix caching makes them (vs_vllm.py's
// `prefix` workload: 8 system prompts of 1,024 tokens, each shared by the requests in flight
// that use it). The decode path reads a shared page once per sharer and scores each key on
// vector units for one token's 3 heads at a time; here a (group, KV head) work item takes all
// sharers' heads as the rows of matrix products, and each member then attends only its own
// tail on the decode path, which merges this part in (paged_attention.cpp's attend_item).
//
// Per item and row block (16 rows: member r / group, query head r % group of this KV head):
//   1. S^T = K Q^T with the keys as they lie in their pages (16 tokens of one page, head dims
//      contiguous, rows a token apart) and the queries in bf16 pairs of head dims, one column
//      per row, so nothing of the cache is rearranged for the scores. On AMX: K is a tile's A
//      operand. Without: each key's pair of head dims is broadcast against the block's 16 rows
//      of that pair (one VDPBF16PS scores one key for 16 rows), 16 keys in flight;
//   2. an exact fp32 softmax down the key axis, 16 rows in the lanes of one vector; its
//      weights rounded to bf16 (as torch's bf16 attention rounds them before P V) in pairs of
//      keys, then transposed to rows of P;
//   3. O = P V, with V interleaved by token pairs (the layout both products take), once per
//      item for all blocks: on AMX as prefill_tile_amx.h's product, without it as
//      prefill_tile_bf16.h's (two tokens' weights times 16 head dims per instruction).
// The result stays unnormalised (PartialAttention), so that the merge is exact up to rounding.
// Needs pages of a multiple of 16 tokens and a prefix of a multiple of 32 keys (the P V step).
#pragma once

#include "prefill_tile_amx.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace pdserve {

// Attention of some query rows over a range of keys, not yet normalised: row r's output is
// acc[r] / sum[r], with weights exp(scale * score - max[r]).
struct PartialAttention {
  std::vector<float> max;  // [rows]
  std::vector<float> sum;  // [rows]
  std::vector<float> acc;  // [rows][D]
};

constexpr int64_t kSharedKeyStep = 32;  // keys per P V product: a prefix is a multiple of it

#if PDSERVE_TILE_BF16
#define PDSERVE_SHARED_PREFIX 1

// Per-thread buffers, grown to the largest item and reused.
struct SharedPrefixScratch {
  std::vector<uint32_t> qt;     // [D/2][16]: bf16 pairs of head dims, one column per row
  std::vector<float> scores_t;  // [keys][16]: S^T
  std::vector<uint32_t> pairs;  // [keys/2][16]: bf16 weights of key pairs (2j, 2j + 1), per row
  std::vector<uint32_t> probs;  // [16][keys/2]: the same, transposed: rows of P
  std::vector<uint16_t> vi;     // [keys/2][D][2]: values interleaved by token pairs
  std::vector<float> out;       // [16][D]: one row block of O
};

constexpr int64_t kSharedRows = 16;  // rows per block: the lanes of a score vector (S^T's columns)

// Step 1 without AMX: scores_t[t][i] = k_t . q_i for the 16 keys of one page from `k` (rows
// `tok_stride` elements apart), each key's head-dim pair p broadcast against qt[p] (16 rows).
// 16 keys in flight: VDPBF16PS's latency is covered, and each qt[p] is loaded once for them.
template <int D>
inline void score_keys_bf16(const c10::BFloat16* k, int64_t tok_stride, const uint32_t* qt, float* scores_t) {
  constexpr int NP = D / 2;
  const uint32_t* kp = reinterpret_cast<const uint32_t*>(k);
  const int64_t row = tok_stride / 2;  // in bf16 pairs
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int p = 0; p < NP; ++p) {
    const __m512i qv = _mm512_loadu_si512(qt + p * kSharedRows);
    for (int j = 0; j < 16; ++j)
      acc[j] = dot_pairs(acc[j], _mm512_set1_epi32(static_cast<int>(kp[j * row + p])), qv);
  }
  for (int j = 0; j < 16; ++j) _mm512_storeu_ps(scores_t + j * kSharedRows, acc[j]);
}

// `amx`: the CPU has AMX tiles and this thread has configured them (prefill_tile_amx.h's
// configuration: every tile 16 rows of 64 bytes); else the AVX512-BF16 steps.
template <int D>
void attend_shared_prefix(const c10::BFloat16* q, int64_t q_tok_stride, int64_t q_head_stride,
                          const int64_t* q_tokens, int64_t members, int64_t group, int64_t kv_head,
                          const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, const int32_t* pages,
                          int64_t page_size, int64_t kv_heads, int64_t shared, float scale, bool amx,
                          SharedPrefixScratch& s, PartialAttention& part) {
  static_assert(D % 32 == 0, "head dims in chunks of 32 (AMX tiles, the V interleave)");
  constexpr int NP = D / 2;
  const int64_t rows = members * group;
  const int64_t tok_stride = kv_heads * D;
  const int64_t half = shared / 2;
  // 16 tokens from t (a multiple of 16, so within one page) of this KV head.
  auto tokens = [&](const c10::BFloat16* cache, int64_t t) {
    return cache + (static_cast<int64_t>(pages[t / page_size]) * page_size + t % page_size) * tok_stride + kv_head * D;
  };
  part.max.resize(rows);
  part.sum.resize(rows);
  part.acc.resize(rows * D);
  s.qt.resize(NP * kSharedRows);
  s.scores_t.resize(shared * kSharedRows);
  s.pairs.resize(half * kSharedRows);
  s.probs.resize(kSharedRows * half);
  s.vi.resize(shared * D);
  s.out.resize(kSharedRows * D);

  // V by token pairs for every row block: lanes (x, x + 32) of two tokens' 16 head dims -> 2x, 2x + 1.
  alignas(64) static const uint16_t interleave[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i vidx = _mm512_load_si512(interleave);
  // Pages lie anywhere in the cache: each loop asks for the page kAhead blocks on (into L2).
  constexpr int64_t kAhead = 4 * 16;
  constexpr int64_t kRowBytes = D * sizeof(c10::BFloat16);
  const int64_t tok_bytes = tok_stride * sizeof(c10::BFloat16);
  for (int64_t t = 0; t < kAhead && t < shared; t += 16) prefetch_page(tokens(v_cache, t), 16, tok_bytes, kRowBytes);
  for (int64_t t = 0; t < shared; t += 16) {
    if (t + kAhead < shared) prefetch_page(tokens(v_cache, t + kAhead), 16, tok_bytes, kRowBytes);
    const uint16_t* v = reinterpret_cast<const uint16_t*>(tokens(v_cache, t));
    for (int64_t j = 0; j < 8; ++j) {
      const uint16_t* v0 = v + 2 * j * tok_stride;
      const uint16_t* v1 = v0 + tok_stride;
      uint16_t* dst = s.vi.data() + (t / 2 + j) * 2 * D;
      for (int c = 0; c < D / 16; ++c) {
        const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + 16 * c)));
        const __m512i b = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + 16 * c)));
        _mm512_storeu_si512(dst + 32 * c, _mm512_permutex2var_epi16(a, vidx, b));
      }
    }
  }
  // Two weights' bf16 (low 16 lanes: key 2j, high: key 2j + 1) -> one 32-bit pair per row.
  alignas(64) static const uint16_t pair_up[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                   8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pidx = _mm512_load_si512(pair_up);

  for (int64_t r0 = 0; r0 < rows; r0 += kSharedRows) {
    const int64_t n = std::min(kSharedRows, rows - r0);
    std::fill(s.qt.begin(), s.qt.end(), 0u);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = r0 + i;
      uint32_t row[NP];
      std::memcpy(row, q + q_tokens[r / group] * q_tok_stride + (kv_head * group + r % group) * q_head_stride,
                  sizeof(row));
      for (int p = 0; p < NP; ++p) s.qt[p * kSharedRows + i] = row[p];
    }
    // 1. S^T, 16 keys (one page's tile) at a time.
    for (int64_t t = 0; t < kAhead && t < shared; t += 16) prefetch_page(tokens(k_cache, t), 16, tok_bytes, kRowBytes);
    for (int64_t t = 0; t < shared; t += 16) {
      if (t + kAhead < shared) prefetch_page(tokens(k_cache, t + kAhead), 16, tok_bytes, kRowBytes);
      const c10::BFloat16* k = tokens(k_cache, t);
#if PDSERVE_TILE_AMX
      if (amx) {
        // C (tile 0: 16 keys x 16 rows) += A (tile 1: 16 keys x 32 dims) x B (tile 2: 16 dim
        // pairs x 16 rows), over the head-dim chunks.
        _tile_zero(0);
        for (int c = 0; c < D / 32; ++c) {
          _tile_loadd(1, k + 32 * c, tok_stride * sizeof(c10::BFloat16));
          _tile_loadd(2, s.qt.data() + 16 * c * kSharedRows, kSharedRows * sizeof(uint32_t));
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, s.scores_t.data() + t * kSharedRows, kSharedRows * sizeof(float));
        continue;
      }
#endif
      score_keys_bf16<D>(k, tok_stride, s.qt.data(), s.scores_t.data() + t * kSharedRows);
    }
    // 2. Softmax down each column; weights exp(scale * (s - max)).
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < shared; ++t) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s.scores_t.data() + t * kSharedRows));
    const __m512 sc = _mm512_set1_ps(scale);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < half; ++j) {
      const float* st = s.scores_t.data() + 2 * j * kSharedRows;
      const __m512 e0 = exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(st), mx), sc));
      const __m512 e1 = exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(st + kSharedRows), mx), sc));
      sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
      _mm512_storeu_si512(s.pairs.data() + j * kSharedRows, _mm512_permutexvar_epi16(pidx, both));
    }
    for (int64_t j = 0; j < half; ++j)
      for (int64_t i = 0; i < kSharedRows; ++i) s.probs[i * half + j] = s.pairs[j * kSharedRows + i];
    // 3. O = P V: P's key pairs are the products' bf16 pairs.
    const uint16_t* probs = reinterpret_cast<const uint16_t*>(s.probs.data());
#if PDSERVE_TILE_AMX
    if (amx)
      pdserve::amx_probs_times_values<D>(probs, half * sizeof(uint32_t), s.vi.data(), shared / kSharedKeyStep,
                                         s.out.data());
#endif
    if (!amx) {
      constexpr int kRows = kValueRowsFor<D>;
      for (int64_t i0 = 0; i0 < n; i0 += kRows) {
        auto store = [&](int r, int c, __m512 acc) { _mm512_storeu_ps(s.out.data() + (i0 + r) * D + 16 * c, acc); };
        with_rows<kRows>(std::min<int64_t>(kRows, n - i0), [&](auto R) {
          accumulate_rows<D, decltype(R)::value>(probs + i0 * shared, shared, s.vi.data(), shared / kKeyBlock, store);
        });
      }
    }
    alignas(64) float m_rows[kSharedRows], sum_rows[kSharedRows];
    _mm512_store_ps(m_rows, _mm512_mul_ps(mx, sc));
    _mm512_store_ps(sum_rows, sum);
    for (int64_t i = 0; i < n; ++i) {
      part.max[r0 + i] = m_rows[i];
      part.sum[r0 + i] = sum_rows[i];
      std::copy(s.out.data() + i * D, s.out.data() + (i + 1) * D, part.acc.data() + (r0 + i) * D);
    }
  }
}

#else
#define PDSERVE_SHARED_PREFIX 0
#endif

}  // namespace pdserve
