// Prefill tiles of bf16 attention on AMX tiles (Intel Sapphire Rapids and later).
//
// Included by paged_attention.cpp, which sends here the bf16 prefill tiles that
// prefill_tile_bf16.h serves elsewhere, when the CPU has AMX. The arithmetic is that file's
// (exact fp32 softmax; its weights rounded to bf16 before P V, as torch's bf16 attention does),
// and so are the key layouts: prefill_tile_bf16.h's `rearrange_keys` already writes K as bf16
// pairs of head dims by 16 keys and V as token pairs by head dims, which are exactly the
// "VNNI" layouts an AMX B tile takes. What changes:
//   1. Keys are rearranged once per (sequence, KV head) for the whole call (`AmxKeys`), not once
//      per item: with AMX multiplying, a 512-token prompt's 32 query tiles each re-reading their
//      keys would cost more than the products.
//   2. S = Q K^T and O = P V are TDPBF16PS on 16 x 16 fp32 tiles: 16 query rows x 32 head dims
//      (or 32 keys) times 32 x 16, 16K FLOP an instruction, against VDPBF16PS's 64.
// Rows beyond an item's last are zero-padded to whole tiles and never written out.
// Measured against torch's flash SDPA on 2 Sapphire Rapids-class cores: see
// engine/model/attention.py.
#pragma once

#include "prefill_tile_bf16.h"

#include "amx.h"

#if PDSERVE_TILE_BF16 && PDSERVE_AMX
#define PDSERVE_TILE_AMX 1
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace pdserve {

// Every tile 16 rows x 64 bytes, before the thread's first item.
inline void configure_attention_tiles() {
  const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
  configure_amx_tiles(rows);
}

constexpr int64_t kAmxRows = 16;  // query rows per tile

// The keys of one (sequence, KV head), rearranged once for all of its tiles: TileScratch's kt
// and vi over [0, context), padded with zero keys to an even number of 16-key blocks (the
// P V tile takes 32 keys).
using AmxKeys = TileScratch;

// Per-thread buffers of the AMX path, grown to the largest item and reused.
struct AmxScratch {
  std::vector<uint16_t> q;      // [rows padded to 16][D] bf16 bits, rows packed contiguously
  std::vector<float> scores;    // [rows padded][row_len]
  std::vector<uint16_t> probs;  // [rows padded][row_len] bf16 bits
  std::vector<float> inv_sum;   // [rows]
  std::vector<float> out;       // [16][D]: one row block of O before normalising
};

// out [16][D] fp32 = P V for one block of 16 rows over `steps` x 32 keys: C tiles 0..3 (16
// head dims each) += A (tile 4: 16 rows of P, bf16, rows `probs_stride` bytes apart, 32 keys) x
// B (tiles 5..7: 16 token pairs x 16 head dims of `vi`, V interleaved by token pairs as
// rearrange_keys writes it). Shared with shared_prefix_amx.h.
template <int D>
inline void amx_probs_times_values(const uint16_t* probs, int64_t probs_stride, const uint16_t* vi, int64_t steps,
                                   float* out) {
  constexpr int kOutTiles = D / 16 < 4 ? D / 16 : 4;  // O tiles held at once (16 head dims each)
  for (int c0 = 0; c0 < D / 16; c0 += kOutTiles) {
    _tile_zero(0);
    if constexpr (kOutTiles > 1) _tile_zero(1);
    if constexpr (kOutTiles > 2) { _tile_zero(2); _tile_zero(3); }
    for (int64_t j = 0; j < steps; ++j) {
      _tile_loadd(4, probs + 32 * j, probs_stride);
      const uint16_t* vb = vi + j * 32 * D + 32 * c0;  // 16 pairs of rows 2D apart
      constexpr int kStride = 2 * D * sizeof(uint16_t);
      _tile_loadd(5, vb, kStride);
      _tile_dpbf16ps(0, 4, 5);
      if constexpr (kOutTiles > 1) { _tile_loadd(6, vb + 32, kStride); _tile_dpbf16ps(1, 4, 6); }
      if constexpr (kOutTiles > 2) {
        _tile_loadd(7, vb + 64, kStride); _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, vb + 96, kStride); _tile_dpbf16ps(3, 4, 5);
      }
    }
    _tile_stored(0, out + 16 * c0, D * sizeof(float));
    if constexpr (kOutTiles > 1) _tile_stored(1, out + 16 * (c0 + 1), D * sizeof(float));
    if constexpr (kOutTiles > 2) {
      _tile_stored(2, out + 16 * (c0 + 2), D * sizeof(float));
      _tile_stored(3, out + 16 * (c0 + 3), D * sizeof(float));
    }
  }
}

// One work item, with the arguments of attend_tile_bf16 but the keys already rearranged.
template <int D>
void attend_tile_amx(const c10::BFloat16* q, int64_t q_tok_stride, int64_t q_head_stride, int64_t q_first,
                     int64_t n_q, int64_t group, int64_t kv_head, int64_t limit0, const AmxKeys& keys,
                     int64_t kv_heads, c10::BFloat16* out, float scale, AmxScratch& s) {
  static_assert(D % 32 == 0, "AMX tiles take head dims in chunks of 32");
  constexpr int NP = D / 2;                  // bf16 pairs per key
  constexpr int kChunks = D / 32;            // A tiles of Q per row (32 head dims each)
  const int64_t rows = n_q * group;
  const int64_t padded = (rows + kAmxRows - 1) / kAmxRows * kAmxRows;
  const int64_t kv_end = limit0 + n_q - 1;
  const int64_t num_blocks = std::min<int64_t>(key_blocks_32(kv_end), static_cast<int64_t>(keys.kt.size()) / (NP * kKeyBlock));
  const int64_t row_len = num_blocks * kKeyBlock;
  const int64_t heads = kv_heads * group;
  s.q.assign(padded * D, 0);
  s.scores.resize(padded * row_len);
  s.probs.resize(padded * row_len);
  s.inv_sum.resize(rows);
  s.out.resize(kAmxRows * D);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(s.q.data() + r * D, q + (q_first + r / group) * q_tok_stride + (kv_head * group + r % group) * q_head_stride,
                D * sizeof(uint16_t));
  auto limit = [&](int64_t r) { return limit0 + r / group; };
  // Key blocks a row block needs: up to its last row's limit, rounded to the 32-key P V step.
  auto blocks_seen = [&](int64_t r0) {
    const int64_t last = std::min(rows, r0 + kAmxRows) - 1;
    return std::min(num_blocks, key_blocks_32(limit(last)));
  };

  // S = Q K^T, tile by tile: C += A (16 rows x 32 dims of Q) x B (16 dim pairs x 16 keys), over
  // the head-dim chunks.
  for (int64_t r0 = 0; r0 < padded; r0 += kAmxRows) {
    const uint16_t* qa = s.q.data() + r0 * D;
    float* srow = s.scores.data() + r0 * row_len;
    const int64_t nb = blocks_seen(r0);  // even: key blocks come in 32-key steps
    if constexpr (kChunks <= 2) {
      // Head dims up to 64: the row block's Q stays in tiles 4-5 for all its keys, and two key
      // blocks are in flight (C tiles 0-1, B tiles 2-3 and 6-7), so each product depends on
      // loads issued a block earlier instead of on the previous product's store.
      _tile_loadd(4, qa, D * sizeof(uint16_t));
      if constexpr (kChunks == 2) _tile_loadd(5, qa + 32, D * sizeof(uint16_t));
      for (int64_t b = 0; b < nb; b += 2) {
        const uint32_t* kb = keys.kt.data() + b * NP * kKeyBlock;
        const uint32_t* kb1 = kb + NP * kKeyBlock;
        constexpr int kStride = kKeyBlock * sizeof(uint32_t);
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(2, kb, kStride);
        _tile_loadd(6, kb1, kStride);
        _tile_dpbf16ps(0, 4, 2);
        _tile_dpbf16ps(1, 4, 6);
        if constexpr (kChunks == 2) {
          _tile_loadd(3, kb + 16 * kKeyBlock, kStride);
          _tile_loadd(7, kb1 + 16 * kKeyBlock, kStride);
          _tile_dpbf16ps(0, 5, 3);
          _tile_dpbf16ps(1, 5, 7);
        }
        _tile_stored(0, srow + b * kKeyBlock, row_len * sizeof(float));
        _tile_stored(1, srow + (b + 1) * kKeyBlock, row_len * sizeof(float));
      }
    } else {
      for (int64_t b = 0; b < nb; ++b) {
        _tile_zero(0);
        const uint32_t* kb = keys.kt.data() + b * NP * kKeyBlock;
        for (int c = 0; c < kChunks; ++c) {
          _tile_loadd(1, qa + 32 * c, D * sizeof(uint16_t));
          _tile_loadd(2, kb + 16 * c * kKeyBlock, kKeyBlock * sizeof(uint32_t));
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, srow + b * kKeyBlock, row_len * sizeof(float));
      }
    }
  }
  // The exact softmax of each row over its visible keys, scaled (zeros up to row_len).
  for (int64_t r = 0; r < rows; ++r)
    s.inv_sum[r] = softmax_row(s.scores.data() + r * row_len, limit(r), row_len, scale, s.probs.data() + r * row_len);
  // O = P V, a block of 16 rows at a time.
  for (int64_t r0 = 0; r0 < padded; r0 += kAmxRows) {
    amx_probs_times_values<D>(s.probs.data() + r0 * row_len, row_len * sizeof(uint16_t), keys.vi.data(),
                              blocks_seen(r0) / 2, s.out.data());
    for (int64_t i = 0; i < kAmxRows && r0 + i < rows; ++i) {
      const int64_t r = r0 + i;
      c10::BFloat16* dst = out + ((q_first + r / group) * heads + kv_head * group + r % group) * D;
      const __m512 inv = _mm512_set1_ps(s.inv_sum[r]);
      for (int c = 0; c < D / 16; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(s.out.data() + i * D + 16 * c), inv)));
    }
  }
}

}  // namespace pdserve

#else
#define PDSERVE_TILE_AMX 0
#endif
