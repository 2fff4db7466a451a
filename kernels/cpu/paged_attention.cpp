// CPU paged attention that reads K/V pages in place, and the fused KV store.
//
// Built at first use by kernels/cpu_ops.py with the other kernels/cpu/ sources
// (torch.utils.cpp_extension, -O3 for this machine's instruction set); kernels/reference.py holds the torch oracle with the same arguments.
//
// Cache layout (as everywhere in kernels/): k_cache, v_cache [num_pages, page_size, kv_heads, d].
// One op serves decode rows and prefill chunks in one mixed batch: query token i of sequence b
// sits at position context_lens[b] - q_len_b + i and sees keys 0..position (cached prefix pages,
// earlier chunks and its own chunk alike).
//
// Work is split into items (sequence, tile of up to kQTile query tokens, one KV head or, when
// there are tiles enough, all of them in turn); for each KV head an item takes all `group`
// query heads that share it, so each K/V page slice is read once per item (GQA-aware). Threads pull items from one atomic counter, because causal prefill tiles
// differ in cost and a static split would leave a core idle.
//
// Per item: queries are scaled and widened to fp32 once; pass 1 walks the pages (prefetching
// pages ahead into L2, since pages lie anywhere in the cache) and scores eight keys at a time for
// two rows at once, reducing the eight dot products with one transpose-and-add tree; an exact
// softmax per row (fp32); pass 2 walks the pages again and adds p * v rows (vectorised across
// d). A prefill tile widens each bf16/fp16 page slice to fp32 once for all its rows; where the
// CPU has AVX512-BF16, bf16 keys are scored in bf16 pairs directly (VDPBF16PS), and a bf16 tile
// of kMinTileQueries or more queries goes to prefill_tile_bf16.h's matrix products instead.
// Nothing is gathered or padded.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "vec.h"
#include "prefill_tile_bf16.h"
#include "prefill_tile_amx.h"
#include "shared_prefix.h"

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PDSERVE_DOT_BF16 1  // VDPBF16PS: bf16 pairs multiplied exactly, summed in fp32
#else
#define PDSERVE_DOT_BF16 0
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace {

using pdserve::dispatch_dtype;
using pdserve::exp8;
using pdserve::hmax;
using pdserve::hsum;
using pdserve::load8;
using pdserve::prefetch_page;
using pdserve::v8f;

// Pages prefetched ahead of the one being read, into L2 (into L1 they evicted the page in use:
// 4 pages ahead into L2 read 1.8x faster than none, on Zen 4 at 32 sequences x 1,200 tokens).
constexpr int64_t kPrefetchPages = 4;
constexpr int64_t kQTile = 16;  // query tokens per work item: bounds the score buffer, feeds both cores

struct Item {
  int64_t seq;
  int64_t q_begin;  // packed token index of the tile's first query
  int64_t q_end;
  int64_t kv_head = 0;
  int64_t num_kv_heads = 1;  // heads kv_head .. kv_head + num_kv_heads - 1, one after the other
  int64_t shared = -1;       // >= 0: these KV heads of SharedPrefix `shared` (seq and q_* unused)
};

// Decode tokens whose page tables begin with the same `keys / page_size` pages (a cached
// prefix), attended as shared_prefix.h describes; members are their tiles.
struct SharedPrefix {
  std::vector<Item> members;
  int64_t keys = 0;
};

// Rows of a decode token (its query heads of one KV head) scored and accumulated in one pass
// over the keys: each K/V row is loaded once for all of them. Three rather than pairs (the
// prefill rows' blocks): builtin:small's 3-head groups read their keys once, not twice, which
// took 32 decodes x 600 tokens from 1.10 to 0.45 ms a layer (bf16, Zen 5, cache-resident);
// four would not fit the registers at head_dim 64.
constexpr int64_t kDecodeRows = 3;

// f(std::integral_constant<int, R>) for R = min(remaining, kDecodeRows).
template <typename F>
inline void with_row_count(int64_t remaining, F&& f) {
  if (remaining >= 3) f(std::integral_constant<int, 3>{});
  else if (remaining == 2) f(std::integral_constant<int, 2>{});
  else f(std::integral_constant<int, 1>{});
}

// Query tokens from which a bf16 tile goes to the matrix-product path of prefill_tile_bf16.h.
constexpr int64_t kMinTileQueries = 4;

// Tiles per thread from which an item takes all of its tile's KV heads (see paged_attention).
constexpr int64_t kTilesPerThreadForWholeItems = 8;

// Scores of 8 keys at once: s[i] holds key i's partial dot products in 8 lanes; returns the 8
// sums in one vector (a transpose-and-add tree, where 8 horizontal sums cost ~5x as much).
inline v8f hadd(v8f a, v8f b) {  // AVX's hadd_ps: pairwise sums, per 128-bit half
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}
inline v8f sum8(const v8f* s) {
  const v8f lo = hadd(hadd(s[0], s[1]), hadd(s[2], s[3]));  // keys 0-3: lanes 0-3 and 4-7 halves
  const v8f hi = hadd(hadd(s[4], s[5]), hadd(s[6], s[7]));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

// One head's slice of a page: `stride` elements between consecutive tokens.
template <typename T>
struct PageSlice {
  const T* base;
  int64_t stride;
  PageSlice from(int64_t token) const { return {base + token * stride, stride}; }
};

// The slice as fp32 rows: the cache itself when it is fp32, else widened once into `buffer`
// (bf16/fp16), so the many query rows of a prefill tile never widen a value (or, without
// AVX512-BF16, a key) again: bf16 prefill attention ran 1.5x faster so. A decode item's few
// rows read the cache directly instead: widening would add a pass over memory-bound data.
template <int NV>
PageSlice<float> widen_page(const float* page, int64_t, int64_t tok_stride, std::vector<float>&) {
  return {page, tok_stride};
}
template <int NV, typename scalar_t>
PageSlice<float> widen_page(const scalar_t* page, int64_t n, int64_t tok_stride, std::vector<float>& buffer) {
  constexpr int64_t d = NV * 8;
  if (static_cast<int64_t>(buffer.size()) < n * d) buffer.resize(n * d);
  for (int64_t j = 0; j < n; ++j)
    for (int c = 0; c < NV; ++c) {
      const v8f v = load8(page + j * tok_stride + 8 * c);
      std::memcpy(buffer.data() + j * d + 8 * c, &v, sizeof(v));
    }
  return {buffer.data(), d};
}

// scores[row][j] = q_row . k_j for R consecutive rows (queries `q`, NV vectors each; score rows
// `row_len` apart) and the page's n keys, eight keys at a time: each key vector is loaded once for
// all R rows. R x 8 accumulators plus R x NV query vectors should fit the register file (R = 2
// at head_dim 64 spills a few, and still beat one row at a time on bf16 prefill tiles).
template <int NV, int R, typename T>
inline void score_rows(const PageSlice<T>& k, int64_t n, const v8f* q, float* scores, int64_t row_len) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    v8f s[R][8];
    for (int i = 0; i < 8; ++i) {
      const T* krow = k.base + (j + i) * k.stride;
      const v8f k0 = load8(krow);
      for (int r = 0; r < R; ++r) s[r][i] = q[r * NV] * k0;
      for (int c = 1; c < NV; ++c) {
        const v8f kc = load8(krow + 8 * c);
        for (int r = 0; r < R; ++r) s[r][i] += q[r * NV + c] * kc;
      }
    }
    for (int r = 0; r < R; ++r) {
      const v8f block = sum8(s[r]);
      std::memcpy(scores + r * row_len + j, &block, sizeof(block));
    }
  }
  for (; j < n; ++j) {
    const T* krow = k.base + j * k.stride;
    for (int r = 0; r < R; ++r) {
      v8f a = q[r * NV] * load8(krow);
      for (int c = 1; c < NV; ++c) a += q[r * NV + c] * load8(krow + 8 * c);
      scores[r * row_len + j] = hsum(a);
    }
  }
}

#if PDSERVE_DOT_BF16
// score_rows for bf16 queries and keys on CPUs with AVX512-BF16: VDPBF16PS multiplies 16 bf16
// pairs exactly and adds them into 8 fp32 lanes, so keys need no widening and one instruction
// does the work of two FMAs. The queries come unscaled (bf16 rows `q`); the scale is applied
// to the sums. Same products as the fp32 path; the sums differ by float rounding only.
template <int NV, int R>
inline void score_rows_dot_bf16(const PageSlice<c10::BFloat16>& k, int64_t n, const c10::BFloat16* const* q,
                                float scale, float* scores, int64_t row_len) {
  static_assert(NV % 2 == 0, "head_dim must be a multiple of 16");
  constexpr int NH = NV / 2;  // vectors of 16 bf16 per row
  __m256bh qv[R][NH];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NH; ++c) qv[r][c] = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + 16 * c));
  auto dot = [&](const c10::BFloat16* krow, __m256* a) {
    for (int r = 0; r < R; ++r) a[r] = _mm256_setzero_ps();
    for (int c = 0; c < NH; ++c) {
      const __m256bh kc = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(krow + 16 * c));
      for (int r = 0; r < R; ++r) a[r] = _mm256_dpbf16_ps(a[r], qv[r][c], kc);
    }
  };
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    v8f s[R][8];
    for (int i = 0; i < 8; ++i) {
      __m256 a[R];
      dot(k.base + (j + i) * k.stride, a);
      for (int r = 0; r < R; ++r) s[r][i] = (v8f)a[r];
    }
    for (int r = 0; r < R; ++r) {
      const v8f block = sum8(s[r]) * scale;
      std::memcpy(scores + r * row_len + j, &block, sizeof(block));
    }
  }
  for (; j < n; ++j) {
    __m256 a[R];
    dot(k.base + j * k.stride, a);
    for (int r = 0; r < R; ++r) scores[r * row_len + j] = hsum((v8f)a[r]) * scale;
  }
}
#endif

// acc[row] += sum_j w[row][j] * v_j over the page's first m values, for R consecutive rows
// (weights `row_len` apart, accumulators NV vectors each): each value vector is loaded once
// for all R rows.
template <int NV, int R, typename T>
inline void accumulate_rows(const PageSlice<T>& v, int64_t m, const float* w, int64_t row_len, v8f* acc) {
  v8f a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) a[r][c] = acc[r * NV + c];
  for (int64_t j = 0; j < m; ++j) {
    const T* vrow = v.base + j * v.stride;
    for (int c = 0; c < NV; ++c) {
      const v8f vc = load8(vrow + 8 * c);
      for (int r = 0; r < R; ++r) a[r][c] += w[r * row_len + j] * vc;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r * NV + c] = a[r][c];
}

// One work item with NV = head_dim / 8 vectors per row (a template, so rows live in registers).
// Row r of the item is (query qi, group member g): r = qi * group + g.
template <typename scalar_t, int NV>
void attend_item(const Item& it, const scalar_t* q, int64_t q_tok_stride, int64_t q_head_stride,
                 const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* page_table,
                 int64_t table_stride, const int32_t* query_start_loc, const int32_t* context_lens,
                 scalar_t* out, int64_t group, int64_t page_size, int64_t kv_heads, float scale,
                 std::vector<v8f>& qf, std::vector<float>& scores, std::vector<v8f>& acc,
                 std::vector<int64_t>& limits, std::vector<float>& page_f, int64_t key_begin = 0,
                 const pdserve::PartialAttention* prefix = nullptr, int64_t prefix_row0 = 0) {
  constexpr int64_t d = NV * 8;
  const int64_t n_q = it.q_end - it.q_begin;
  const int64_t rows = n_q * group;
  const int64_t seq_begin = query_start_loc[it.seq];
  const int64_t q_len = query_start_loc[it.seq + 1] - seq_begin;
  const int64_t first_pos = static_cast<int64_t>(context_lens[it.seq]) - q_len;
  // Keys visible to the tile's last query; row r sees limits[r] keys.
  const int64_t kv_end = first_pos + (it.q_end - seq_begin);
  const int64_t tok_stride = kv_heads * d;  // between consecutive tokens of a page
  const int64_t page_stride = page_size * tok_stride;
  const int64_t slice_bytes = d * static_cast<int64_t>(sizeof(scalar_t));  // one token's row of this head
  const int32_t* pages = page_table + it.seq * table_stride;
  // Scores rows padded to whole 8-key blocks of every page, so a block never writes past its row.
  const int64_t num_pages = (kv_end + page_size - 1) / page_size;
  const int64_t row_len = num_pages * page_size + 8;
  // With a prefix part already attended (keys [0, key_begin), a whole number of pages and of
  // 8-key blocks), the item reads only its own keys and merges that part in at the end.
  const int64_t first_page = key_begin / page_size;

  qf.resize(rows * NV);
  scores.resize(rows * row_len);
  acc.assign(rows * NV, v8f{});
  limits.resize(rows);
  auto q_row = [&](int64_t r) {  // row r's query, as the caller passed it
    return q + (it.q_begin + r / group) * q_tok_stride + (it.kv_head * group + r % group) * q_head_stride;
  };
  for (int64_t qi = 0; qi < n_q; ++qi) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = qi * group + g;
      const scalar_t* src = q_row(r);
      for (int c = 0; c < NV; ++c) qf[r * NV + c] = load8(src + 8 * c) * scale;
      limits[r] = first_pos + (it.q_begin - seq_begin) + qi + 1;
    }
  }
  auto page_base = [&](const scalar_t* cache, int64_t p) {
    return cache + static_cast<int64_t>(pages[p]) * page_stride + it.kv_head * d;
  };
  auto page_tokens = [&](int64_t p) { return std::min(page_size, kv_end - p * page_size); };

  // A decode token's rows (its query heads of this KV head), kDecodeRows at a time, for both
  // passes; the whole-group case is a call of its own so that the row count is a constant there.
  auto each_decode_block = [&](auto&& f) {
    if (rows == kDecodeRows) return f(int64_t{0}, std::integral_constant<int, kDecodeRows>{});
    for (int64_t r = 0; r < rows; r += kDecodeRows) with_row_count(rows - r, [&](auto R) { f(r, R); });
  };

  // Pass 1: scores[r, t] = q_r . k_t, page by page; a page's K slice stays in L1 while every
  // row that can see it takes it, eight keys at a time. Keys past a row's limit within its
  // last page are scored too and never read.
  for (int64_t p = first_page; p < std::min(first_page + kPrefetchPages, num_pages); ++p)
    prefetch_page(page_base(k_cache, p), page_tokens(p), tok_stride * sizeof(scalar_t), slice_bytes);
  for (int64_t p = first_page; p < num_pages; ++p) {
    const int64_t t0 = p * page_size;
    const int64_t n = page_tokens(p);
    if (p + kPrefetchPages < num_pages)
      prefetch_page(page_base(k_cache, p + kPrefetchPages), page_tokens(p + kPrefetchPages),
                    tok_stride * sizeof(scalar_t), slice_bytes);
    // Two rows at a time share each key load; rows are in query order, so when row r sees
    // the page, row r + 1 does too. score(r, R) scores rows r .. r + R - 1.
    auto each_row_block = [&](auto&& score) {
      if (n_q == 1) return each_decode_block(score);  // one decode token's heads see the same keys
      int64_t r = 0;
      for (; r + 1 < rows; r += 2) {
        if (limits[r] <= t0) {  // causal: the page is in row r's future (r + 1 may still see it)
          if (limits[r + 1] > t0) score(r + 1, std::integral_constant<int, 1>{});
          continue;
        }
        score(r, std::integral_constant<int, 2>{});
      }
      if (r < rows && limits[r] > t0) score(r, std::integral_constant<int, 1>{});
    };
    auto score_page = [&](const auto& kp) {
      each_row_block([&](int64_t r, auto R) {
        score_rows<NV, decltype(R)::value>(kp, n, qf.data() + r * NV, scores.data() + r * row_len + t0, row_len);
      });
    };
#if PDSERVE_DOT_BF16
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      const PageSlice<scalar_t> kp{page_base(k_cache, p), tok_stride};
      each_row_block([&](int64_t r, auto R) {
        constexpr int kR = decltype(R)::value;
        const scalar_t* rows_q[kR];
        for (int i = 0; i < kR; ++i) rows_q[i] = q_row(r + i);
        score_rows_dot_bf16<NV, kR>(kp, n, rows_q, scale, scores.data() + r * row_len + t0, row_len);
      });
      continue;
    }
#endif
    if (n_q == 1)
      score_page(PageSlice<scalar_t>{page_base(k_cache, p), tok_stride});
    else
      score_page(widen_page<NV>(page_base(k_cache, p), n, tok_stride, page_f));
  }

  // Softmax per row over its visible keys, eight scores at a time (unnormalised; the sum's
  // inverse is applied at the end).
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores.data() + r * row_len;
    const int64_t lim = limits[r], lim8 = lim - lim % 8;
    v8f mv = v8f{} - std::numeric_limits<float>::infinity();
    for (int64_t t = key_begin; t < lim8; t += 8) {
      const v8f x = load8(s + t);
      mv = x > mv ? x : mv;
    }
    float m = hmax(mv);
    for (int64_t t = std::max(lim8, key_begin); t < lim; ++t) m = std::max(m, s[t]);
    v8f sv{};
    for (int64_t t = key_begin; t < lim8; t += 8) {
      const v8f e = exp8(load8(s + t) - m);
      std::memcpy(s + t, &e, sizeof(e));
      sv += e;
    }
    float sum = hsum(sv);
    for (int64_t t = std::max(lim8, key_begin); t < lim; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    // The query is no longer needed: keep the normaliser there, and for a merge the max and sum.
    qf[r * NV][0] = 1.f / sum;
    qf[r * NV][1] = m;
    qf[r * NV][2] = sum;
  }

  // Pass 2: out_r = sum_t p[r, t] * v_t; a page's V slice stays in L1 while every row takes it.
  for (int64_t p = first_page; p < std::min(first_page + kPrefetchPages, num_pages); ++p)
    prefetch_page(page_base(v_cache, p), page_tokens(p), tok_stride * sizeof(scalar_t), slice_bytes);
  for (int64_t p = first_page; p < num_pages; ++p) {
    const int64_t t0 = p * page_size;
    const int64_t n = page_tokens(p);
    if (p + kPrefetchPages < num_pages)
      prefetch_page(page_base(v_cache, p + kPrefetchPages), page_tokens(p + kPrefetchPages),
                    tok_stride * sizeof(scalar_t), slice_bytes);
    auto accumulate_page = [&](const auto& vp) {
      if (n_q == 1)  // as in pass 1
        return each_decode_block([&](int64_t r, auto R) {
          accumulate_rows<NV, decltype(R)::value>(vp, n, scores.data() + r * row_len + t0, row_len, acc.data() + r * NV);
        });
      int64_t r = 0;
      for (; r + 1 < rows; r += 2) {  // two rows share each value load, as in pass 1
        const int64_t m0 = std::min(n, limits[r] - t0), m1 = std::min(n, limits[r + 1] - t0);
        if (m0 > 0) {
          accumulate_rows<NV, 2>(vp, m0, scores.data() + r * row_len + t0, row_len, acc.data() + r * NV);
          if (m1 > m0)
            accumulate_rows<NV, 1>(vp.from(m0), m1 - m0, scores.data() + (r + 1) * row_len + t0 + m0, row_len,
                                   acc.data() + (r + 1) * NV);
        } else if (m1 > 0) {
          accumulate_rows<NV, 1>(vp, m1, scores.data() + (r + 1) * row_len + t0, row_len, acc.data() + (r + 1) * NV);
        }
      }
      if (r < rows) {
        const int64_t m = std::min(n, limits[r] - t0);
        if (m > 0) accumulate_rows<NV, 1>(vp, m, scores.data() + r * row_len + t0, row_len, acc.data() + r * NV);
      }
    };
    if (n_q == 1)
      accumulate_page(PageSlice<scalar_t>{page_base(v_cache, p), tok_stride});
    else
      accumulate_page(widen_page<NV>(page_base(v_cache, p), n, tok_stride, page_f));
  }

  const int64_t heads = kv_heads * group;
  for (int64_t qi = 0; qi < n_q; ++qi) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = qi * group + g;
      scalar_t* dst = out + ((it.q_begin + qi) * heads + it.kv_head * group + g) * d;
      if (prefix) {  // softmax over both parts: each part's sums rescaled to the larger max
        const int64_t pr = prefix_row0 + r;
        const float m = std::max(qf[r * NV][1], prefix->max[pr]);
        const float own = std::exp(qf[r * NV][1] - m), pre = std::exp(prefix->max[pr] - m);
        const float inv = 1.f / (qf[r * NV][2] * own + prefix->sum[pr] * pre);
        const float* pa = prefix->acc.data() + pr * d;
        for (int c = 0; c < NV; ++c) {
          const v8f o = (acc[r * NV + c] * own + load8(pa + 8 * c) * pre) * inv;
          for (int x = 0; x < 8; ++x) dst[8 * c + x] = static_cast<scalar_t>(o[x]);
        }
        continue;
      }
      const float inv = qf[r * NV][0];
      for (int c = 0; c < NV; ++c) {
        const v8f o = acc[r * NV + c] * inv;
        for (int x = 0; x < 8; ++x) dst[8 * c + x] = static_cast<scalar_t>(o[x]);
      }
    }
  }
}

#if PDSERVE_TILE_BF16
// The keys of every sequence with a prefill tile (kMinTileQueries or more queries), rearranged
// once per KV head over its whole context for the matrix-product tiles (prefill_tile_bf16.h's
// layout, which the AMX tiles read too), in parallel; `slot[seq]` indexes them (by slot *
// kv_heads + head).
template <int D>
std::vector<pdserve::TileScratch> rearrange_prefill_keys(const std::vector<Item>& items, const c10::BFloat16* kc,
                                                         const c10::BFloat16* vc, const int32_t* table,
                                                         int64_t table_stride, int64_t page_size, int64_t kv_heads,
                                                         const int32_t* lens, std::vector<int64_t>& slot) {
  std::vector<int64_t> seqs;
  for (const Item& item : items) {
    if (item.q_end - item.q_begin < kMinTileQueries) continue;
    if (item.seq >= static_cast<int64_t>(slot.size())) slot.resize(item.seq + 1, -1);
    if (slot[item.seq] < 0) {
      slot[item.seq] = static_cast<int64_t>(seqs.size());
      seqs.push_back(item.seq);
    }
  }
  if (seqs.empty()) return {};
  std::vector<pdserve::TileScratch> keys(seqs.size() * kv_heads);
  at::parallel_for(0, static_cast<int64_t>(keys.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t seq = seqs[i / kv_heads], h = i % kv_heads;
      pdserve::rearrange_keys<D>(kc, vc, table + seq * table_stride, page_size, kv_heads * D, h * D, lens[seq],
                                 pdserve::key_blocks_32(lens[seq]), keys[i]);
    }
  });
  return keys;
}
#endif

// Threads pull items from one counter until none is left.
template <typename scalar_t, int NV>
void run_items(const std::vector<Item>& items, const at::Tensor& query, const at::Tensor& k_cache,
               const at::Tensor& v_cache, const at::Tensor& page_table, const int32_t* starts,
               const int32_t* lens, at::Tensor& out, int64_t group, double scale,
               const std::vector<SharedPrefix>& shared) {
  const int64_t kv_heads = k_cache.size(2);
  const int64_t num_items = static_cast<int64_t>(items.size());
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* kc = k_cache.data_ptr<scalar_t>();
  const scalar_t* vc = v_cache.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int32_t* table = page_table.data_ptr<int32_t>();
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
#if PDSERVE_TILE_BF16
  // Each bf16 prefill sequence's keys are rearranged once, by KV head, before the items run.
  std::vector<int64_t> key_slot;
  std::vector<pdserve::TileScratch> prefill_keys;
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && (NV * 8) % 32 == 0)
    prefill_keys = rearrange_prefill_keys<NV * 8>(items, kc, vc, table, page_table.size(1), k_cache.size(1), kv_heads,
                                                  lens, key_slot);
#endif
#if PDSERVE_TILE_AMX
  const bool amx = !prefill_keys.empty() && pdserve::amx_ready();
  const bool shared_amx = !shared.empty() && pdserve::amx_ready();  // the groups' products on AMX tiles
#else
  constexpr bool shared_amx = false;
#endif
  const int64_t page_size = k_cache.size(1), table_stride = page_table.size(1);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<v8f> qf, acc;
    std::vector<float> scores;
    std::vector<int64_t> limits;
    std::vector<float> page_f;
#if PDSERVE_TILE_BF16
    pdserve::TileScratch tile_scratch;
#endif
#if PDSERVE_TILE_AMX
    pdserve::AmxScratch amx_scratch;
    if (amx || shared_amx) pdserve::configure_attention_tiles();
#endif
#if PDSERVE_SHARED_PREFIX
    pdserve::SharedPrefixScratch prefix_scratch;
    pdserve::PartialAttention prefix;
    std::vector<int64_t> q_tokens;
#endif
    for (int64_t i = next++; i < num_items; i = next++) {
      const Item& item = items[i];
#if PDSERVE_SHARED_PREFIX
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && (NV * 8) % 32 == 0) {
        if (item.shared >= 0) {  // KV heads of a shared prefix's group (shared_prefix.h)
          constexpr int D = NV * 8;
          const SharedPrefix& sp = shared[item.shared];
          for (int64_t h = item.kv_head; h < item.kv_head + item.num_kv_heads; ++h) {
            q_tokens.clear();
            for (const Item& m : sp.members) q_tokens.push_back(m.q_begin);
            pdserve::attend_shared_prefix<D>(q, query.stride(0), query.stride(1), q_tokens.data(),
                                             static_cast<int64_t>(q_tokens.size()), group, h, kc, vc,
                                             table + sp.members[0].seq * table_stride, page_size, kv_heads,
                                             sp.keys, static_cast<float>(scale), shared_amx, prefix_scratch, prefix);
            for (size_t m = 0; m < sp.members.size(); ++m)
              attend_item<scalar_t, NV>({sp.members[m].seq, sp.members[m].q_begin, sp.members[m].q_end, h}, q,
                                        query.stride(0), query.stride(1), kc, vc, table, table_stride, starts, lens, o,
                                        group, page_size, kv_heads, static_cast<float>(scale), qf, scores, acc, limits,
                                        page_f, sp.keys, &prefix, static_cast<int64_t>(m) * group);
          }
          continue;
        }
      }
#endif
#if PDSERVE_TILE_BF16
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && (NV * 8) % 32 == 0) {
        if (item.q_end - item.q_begin >= kMinTileQueries) {
          const int64_t q_len = starts[item.seq + 1] - starts[item.seq];
          const int64_t limit0 = lens[item.seq] - q_len + (item.q_begin - starts[item.seq]) + 1;
#if PDSERVE_TILE_AMX
          if (amx) {
            for (int64_t h = item.kv_head; h < item.kv_head + item.num_kv_heads; ++h)
              pdserve::attend_tile_amx<NV * 8>(q, query.stride(0), query.stride(1), item.q_begin,
                                               item.q_end - item.q_begin, group, h, limit0,
                                               prefill_keys[key_slot[item.seq] * kv_heads + h], kv_heads, o,
                                               static_cast<float>(scale), amx_scratch);
            continue;
          }
#endif
          for (int64_t h = item.kv_head; h < item.kv_head + item.num_kv_heads; ++h)
            pdserve::attend_tile_bf16<NV * 8>(q, query.stride(0), query.stride(1), item.q_begin,
                                              item.q_end - item.q_begin, group, h, limit0,
                                              prefill_keys[key_slot[item.seq] * kv_heads + h], kv_heads, o,
                                              static_cast<float>(scale), tile_scratch);
          continue;
        }
      }
#endif
      for (int64_t h = item.kv_head; h < item.kv_head + item.num_kv_heads; ++h)
        attend_item<scalar_t, NV>({item.seq, item.q_begin, item.q_end, h}, q, query.stride(0), query.stride(1), kc,
                                  vc, table, page_table.size(1), starts, lens, o, group, k_cache.size(1), kv_heads,
                                  static_cast<float>(scale), qf, scores, acc, limits, page_f);
    }
#if PDSERVE_TILE_AMX
    if (amx || shared_amx) _tile_release();
#endif
  });
}

// Fewest sequences and shared keys for which a group is attended as one (shared_prefix.h):
// below them the decode path's grouping by first page (see paged_attention) does as well.
constexpr size_t kMinSharers = 2;
constexpr int64_t kMinSharedKeys = 64;

// How many sequences `members` (decode tiles) are. A speculating sequence's verification sends
// its last token and k proposed ones as 1 + k decode entries over the same pages
// (engine/model_runner.py), and each must be computed as plain decoding computes it, which
// alone is never a group: the group path rounds the prefix's softmax weights to bf16 where the
// decode path keeps fp32, and those last bits flipped greedy tokens (spec_decode.py at 256
// output tokens). Two entries are one sequence where their tables agree on the page holding
// the shorter one's last token: each sequence writes its own token's K/V into a page of its
// own, so two sequences' tables never agree there (a prefix cache shares full pages only).
size_t count_sequences(const std::vector<size_t>& members, const std::vector<Item>& tiles, const int32_t* table,
                       int64_t table_stride, const int32_t* lens, int64_t page_size) {
  std::vector<int64_t> seqs;  // one entry of each sequence found so far
  for (size_t i : members) {
    const int64_t b = tiles[i].seq;
    auto same = [&](int64_t a) {
      const int64_t page = (std::min(lens[a], lens[b]) - 1) / page_size;
      return table[a * table_stride + page] == table[b * table_stride + page];
    };
    if (std::none_of(seqs.begin(), seqs.end(), same)) seqs.push_back(b);
  }
  return seqs.size();
}

// Takes out of `tiles` the decode tokens whose sequences begin with the same whole pages, as
// groups of SharedPrefix, heaviest first (threads pull them first).
std::vector<SharedPrefix> take_shared_prefixes(std::vector<Item>& tiles, const int32_t* table, int64_t table_stride,
                                               const int32_t* lens, int64_t page_size) {
  std::unordered_map<int32_t, std::vector<size_t>> by_first_page;
  for (size_t i = 0; i < tiles.size(); ++i)
    if (tiles[i].q_end - tiles[i].q_begin == 1 && lens[tiles[i].seq] >= kMinSharedKeys)
      by_first_page[table[tiles[i].seq * table_stride]].push_back(i);
  std::vector<SharedPrefix> groups;
  std::vector<char> taken(tiles.size(), 0);
  for (const auto& [page, members] : by_first_page) {
    if (count_sequences(members, tiles, table, table_stride, lens, page_size) < kMinSharers) continue;
    // Whole pages every member has, the same in every member's table from the first on.
    int64_t pages = std::numeric_limits<int64_t>::max();
    for (size_t i : members) pages = std::min<int64_t>(pages, lens[tiles[i].seq] / page_size);
    const int32_t* first = table + tiles[members[0]].seq * table_stride;
    for (size_t i : members) {
      const int32_t* row = table + tiles[i].seq * table_stride;
      int64_t p = 0;
      while (p < pages && row[p] == first[p]) ++p;
      pages = p;
    }
    // Whole 32-key steps of the prefix's P V (pages hold a multiple of 16 tokens).
    if ((pages * page_size) % pdserve::kSharedKeyStep) --pages;
    if (pages * page_size < kMinSharedKeys) continue;
    SharedPrefix group{{}, pages * page_size};
    for (size_t i : members) {
      group.members.push_back(tiles[i]);
      taken[i] = 1;
    }
    groups.push_back(std::move(group));
  }
  size_t kept = 0;
  for (size_t i = 0; i < tiles.size(); ++i)
    if (!taken[i]) tiles[kept++] = tiles[i];
  tiles.resize(kept);
  auto work = [](const SharedPrefix& g) { return g.keys * static_cast<int64_t>(g.members.size()); };
  std::stable_sort(groups.begin(), groups.end(), [&](const auto& a, const auto& b) { return work(a) > work(b); });
  return groups;
}

void check_cache(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(query.dim() == 3, "query must be [num_tokens, num_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be [num_pages, page_size, kv_heads, head_dim] and alike");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "query and cache must share a dtype");
  TORCH_CHECK(query.size(2) == k_cache.size(3), "query head_dim differs from the cache's");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of kv_heads");
  TORCH_CHECK(query.stride(2) == 1, "query rows must be contiguous in head_dim");
}

}  // namespace

at::Tensor paged_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                              at::Tensor page_table, at::Tensor query_start_loc,
                              at::Tensor context_lens, double scale) {
  check_cache(query, k_cache, v_cache);
  TORCH_CHECK(page_table.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                  context_lens.scalar_type() == at::kInt,
              "page_table, query_start_loc and context_lens must be int32");
  page_table = page_table.contiguous();
  query_start_loc = query_start_loc.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t num_seqs = context_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && page_table.size(0) == num_seqs,
              "page_table, query_start_loc and context_lens disagree on the number of sequences");
  const int64_t kv_heads = k_cache.size(2), head_dim = k_cache.size(3), page_size = k_cache.size(1);
  const int64_t group = query.size(1) / kv_heads;
  auto out = at::empty({query.size(0), query.size(1), head_dim}, query.options());

  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  TORCH_CHECK(starts[num_seqs] == query.size(0), "query_start_loc does not end at num_tokens");
  std::vector<Item> tiles;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b];
    TORCH_CHECK(q_len >= 0 && lens[b] >= q_len, "sequence ", b, " has more query tokens than context");
    TORCH_CHECK((lens[b] + page_size - 1) / page_size <= page_table.size(1), "sequence ", b,
                " has more context than its page table row covers");
    for (int64_t q0 = starts[b]; q0 < starts[b + 1]; q0 += kQTile)
      tiles.push_back({b, q0, std::min<int64_t>(q0 + kQTile, starts[b + 1])});
  }
  // Decode tokens sharing a cached prefix: attended as groups where it can (bf16 on AMX or
  // AVX512-BF16, head dims in 32s, pages of whole 16-token tiles), one item per group and KV
  // head, ahead of the rest. 32 decodes x 1,224 tokens over 8 shared 1,024-token prefixes, 12
  // layers, bf16, 2 threads (benchmarks/decode_attention.py, Sapphire Rapids-class, on AMX):
  // 20.9-21.2 -> 14.6 ms a step.
  std::vector<SharedPrefix> shared;
#if PDSERVE_SHARED_PREFIX
  if (query.scalar_type() == at::kBFloat16 && head_dim % 32 == 0 && page_size % 16 == 0)
    shared = take_shared_prefixes(tiles, page_table.data_ptr<int32_t>(), page_table.size(1), lens, page_size);
#endif
  // Longest tiles (most keys) first, so the tail of the counter holds the cheap ones. Decode
  // tokens whose sequences share their first page (a cached prefix) are taken one after another,
  // at the place of the longest of them, so the shared pages come from DRAM once and then from
  // cache: 32 decodes over 8 shared 1,024-token prefixes (+200 tokens each), 12 layers, bf16,
  // 2 threads: 22.9 -> 18.8 ms against sorting by length alone (benchmarks/decode_attention.py).
  const int32_t* table = page_table.data_ptr<int32_t>();
  auto keys = [&](const Item& t) -> int64_t { return lens[t.seq] - (starts[t.seq + 1] - t.q_end); };
  auto first_page = [&](const Item& t) -> int64_t {
    return t.q_end - t.q_begin == 1 ? table[t.seq * page_table.size(1)] : -1;
  };
  std::unordered_map<int64_t, int64_t> longest;  // first page -> keys of its longest decode
  for (const Item& t : tiles)
    if (first_page(t) >= 0) longest[first_page(t)] = std::max(longest[first_page(t)], keys(t));
  auto rank = [&](const Item& t) { return first_page(t) >= 0 ? longest[first_page(t)] : keys(t); };
  std::stable_sort(tiles.begin(), tiles.end(), [&](const Item& a, const Item& b) {
    if (rank(a) != rank(b)) return rank(a) > rank(b);
    if (first_page(a) != first_page(b)) return first_page(a) < first_page(b);
    return keys(a) > keys(b);
  });
  if (tiles.empty() && shared.empty()) return out;
  // Each head is attended on its own slice of the pages (one head's rows at a time beat whole
  // pages per decode row: 21 vs 17 GB/s at 32 sequences x 1,200 tokens on Zen 4). With tiles
  // enough to feed every thread, one item takes a tile's KV heads one after the other on one
  // core: the hardware prefetcher, fetching a head's slice, brings in its neighbours' lines
  // too (they share cache lines' pages), and the next head then finds them in this core's L2
  // instead of another core's fetching them again. Measured on Sapphire Rapids, bf16, 32
  // sequences x 526 tokens, captured from a decode step: 1.20 -> 0.96 ms a layer; fp32 prefill
  // of 512 tokens 3.14 -> 2.84 ms. With few tiles (batch 1), items stay per head, so both cores
  // have work.
  std::vector<Item> items;
  items.reserve((tiles.size() + shared.size()) * kv_heads);
  // A group's KV heads one after another on one core where there are groups enough for every
  // thread (the reason is the tiles', below), else one item per head.
  const bool whole_groups = static_cast<int64_t>(shared.size()) >= 2 * at::get_num_threads();
  for (size_t g = 0; g < shared.size(); ++g) {
    if (whole_groups) items.push_back({-1, 0, 0, 0, kv_heads, static_cast<int64_t>(g)});
    else
      for (int64_t h = 0; h < kv_heads; ++h) items.push_back({-1, 0, 0, h, 1, static_cast<int64_t>(g)});
  }
  if (static_cast<int64_t>(tiles.size()) >= kTilesPerThreadForWholeItems * at::get_num_threads()) {
    for (const Item& t : tiles) items.push_back({t.seq, t.q_begin, t.q_end, 0, kv_heads});
  } else {
    for (const Item& t : tiles)
      for (int64_t h = 0; h < kv_heads; ++h) items.push_back({t.seq, t.q_begin, t.q_end, h});
  }

  dispatch_dtype(query.scalar_type(), "paged_attention", [&](auto tag) {
    using scalar_t = decltype(tag);
    switch (head_dim) {  // keep in step with kernels/cpu_ops.py HEAD_DIMS
#define PDSERVE_HEAD_DIM(D) \
  case D: \
    run_items<scalar_t, D / 8>(items, query, k_cache, v_cache, page_table, starts, lens, out, group, scale, shared); \
    break;
      PDSERVE_HEAD_DIM(16) PDSERVE_HEAD_DIM(32) PDSERVE_HEAD_DIM(48) PDSERVE_HEAD_DIM(64)
      PDSERVE_HEAD_DIM(80) PDSERVE_HEAD_DIM(96) PDSERVE_HEAD_DIM(128) PDSERVE_HEAD_DIM(256)
#undef PDSERVE_HEAD_DIM
      default: TORCH_CHECK(false, "head_dim ", head_dim, " has no compiled kernel");
    }
  });
  return out;
}

bool shared_prefix_attention_supported() {
  return PDSERVE_SHARED_PREFIX != 0;
}

bool amx_attention_supported() {
#if PDSERVE_TILE_AMX
  return pdserve::amx_ready();
#else
  return false;
#endif
}

void store_kv(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache,
              at::Tensor slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key and value must be [num_tokens, kv_heads, d]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3), "key shape differs from the cache's");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.size(0) == key.size(0),
              "slot_mapping must be int64 [num_tokens]");
  key = key.to(k_cache.scalar_type());
  value = value.to(v_cache.scalar_type());
  if (key.stride(2) != 1 || key.stride(1) != key.size(2)) key = key.contiguous();
  if (value.stride(2) != 1 || value.stride(1) != value.size(2)) value = value.contiguous();
  slot_mapping = slot_mapping.contiguous();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row = k_cache.size(2) * k_cache.size(3);  // elements per token, heads contiguous
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < key.size(0); ++t)
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " is outside the cache's ", num_slots, " slots");
  dispatch_dtype(k_cache.scalar_type(), "store_kv", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* k = key.data_ptr<scalar_t>();
    const scalar_t* v = value.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const int64_t ks = key.stride(0), vs = value.stride(0);
    for (int64_t t = 0; t < key.size(0); ++t) {
      if (slots[t] < 0) continue;  // a negative slot means "skip this token"
      std::copy(k + t * ks, k + t * ks + row, kc + slots[t] * row);
      std::copy(v + t * vs, v + t * vs + row, vc + slots[t] * row);
    }
  });
}
