// y = x W^T (+ b) for bf16 activation rows (decode steps; on AMX, prefill chunks as well),
// reading the weight in the blocked layout oneDNN packed it into at load (kernels/packed_linear.py),
// so decode steps of 1-4 sequences stream the weights at memory speed without a second, plain
// copy of them.
//
// Why: oneDNN's own kernel for such skinny products moved 21-24 GB/s of packed weights on a
// 2-core Sapphire Rapids where a streaming read gets ~28 GB/s and this loop gets 28-33; at batch
// 1 a decode step is ~80% weight streaming.
//
// The layouts, for weight [N, K]: blocks of NB output rows (outer), each split into tiles of KB
// inputs, each tile [KB/2 input pairs][NB outputs][2 inputs of the pair]. oneDNN picks NB = 32,
// KB = 32 on AMX CPUs (`AB16b32a2b`) and NB = 64, KB = K (one tile per block) with AVX512-BF16
// alone (Zen 4/5). A 64-byte line holds 16 outputs x one input pair, which VDPBF16PS multiplies
// by a broadcast pair of x and adds into 16 fp32 lanes, so no horizontal sum is ever needed.
// kernels/packed_linear.py checks, per weight, which layout oneDNN chose (a probe product
// against F.linear) before this kernel is used; other layouts keep oneDNN.
// Needs AVX512-BF16; elsewhere `packed_gemv_supported()` is false.
//
// On AMX CPUs (32 x 32 tiles), any number of rows can go to tile products instead (run_amx; how
// many do is kernels/packed_linear.py max_rows): each 32 x 32
// weight tile is two AMX B tiles as it lies (16 input pairs x 16 outputs, rows 128 bytes
// apart), x is the A tile as it lies (up to 16 rows x 32 inputs, two A tiles past 16 rows), so
// nothing is repacked. Why: oneDNN's AMX kernel moved 15-21 GB/s of packed weights at 2-32
// rows (builtin:small, 2 Sapphire Rapids-class cores, 25 GB/s streaming read), and VDPBF16PS
// becomes compute-bound from 2 rows.
//
// Both paths round their fp32 sums (+ bias) to bf16 as they store them, instead of writing an
// fp32 [M, N] that a second pass (y.to(bf16)) read back and converted: builtin:small's 12
// layers + vocabulary projection at 32 rows took 9.6-9.7 ms against 10.8-11.3 (16 rows: 8.3-8.5
// against 8.6-9.1), and an offline burst (benchmarks/engine_burst.py, with this session's
// prefill attention change) 5.71-5.94 against 5.38-5.50 req/s (four runs each, alternating).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "amx.h"

namespace {

constexpr int kMaxRows = 8;  // rows whose sums all stay in registers (block); run_tiled takes more
constexpr int64_t kPrefetchTiles = 8;  // weight tiles (2 KiB each) requested ahead on AMX

// Runs f(begin, end) over output blocks [0, blocks) on every thread, each thread pulling `grain`
// blocks at a time from one counter. Why not a static half each: in a served step the router
// and the client share the two cores, and a thread they preempt held up the other at the end
// of every product (served bursts ran 15-20% below the same workload offline).
template <typename F>
void for_blocks(int64_t blocks, int64_t grain, F&& f) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), (blocks + grain - 1) / grain);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t b = next.fetch_add(grain); b < blocks; b = next.fetch_add(grain)) f(b, std::min(blocks, b + grain));
  });
}

// The most rows the tiled (non-AMX) path serves; named outside the AVX512-BF16 block because
// packed_gemv's argument check uses it on every CPU (an AVX2-only build needs it too).
constexpr int kMaxTiledRows = 64;

#if defined(__AVX512BF16__)
// 16 fp32 outputs [o, o + 16) of one row: + bias (when there is one), rounded to bf16 into
// `row`. The sum is rounded once, in fp32 and then to bf16, as F.linear's bf16 product is; the
// kernel writes the bf16 result itself rather than an fp32 [M, N] that a second pass converts.
inline void store_outputs(__m512 v, const float* bias, int64_t o, uint16_t* row) {
  if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + o));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + o), (__m256i)_mm512_cvtneps_pbh(v));
}

// Output block `ob` (NB outputs) for M rows of x (each K bf16, `ldx` apart): (+ bias) into y.
template <int M, int NB>
inline void block(const uint16_t* w, const uint16_t* x, int64_t ldx, int64_t k, int64_t kb_size, int64_t ob,
                  const float* bias, uint16_t* y, int64_t ldy) {
  constexpr int NV = NB / 16;  // 16 outputs per vector
  __m512 acc[M][NV];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  const uint16_t* tile = w + ob * k * NB;  // the output block's K / KB tiles, one after another
  for (int64_t kb = 0; kb < k; kb += kb_size, tile += kb_size * NB) {
    for (int64_t j = 0; j < kb_size / 2; ++j) {  // input pair kb + 2j, kb + 2j + 1
      __m512bh wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(tile + j * 2 * NB + 32 * v);
      for (int m = 0; m < M; ++m) {
        uint32_t pair;
        __builtin_memcpy(&pair, x + m * ldx + kb + 2 * j, sizeof(pair));
        const __m512bh xp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], wv[v], xp);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v) store_outputs(acc[m][v], bias, ob * NB + 16 * v, y + m * ldy);
}

template <int M, int NB>
void run(const uint16_t* w, const uint16_t* x, int64_t ldx, int64_t k, int64_t kb_size, int64_t n, const float* bias,
         uint16_t* y) {
  // A grain of 128 outputs: each pull streams a run of W front to back.
  for_blocks(n / NB, std::max(1, 128 / NB), [&](int64_t begin, int64_t end) {
    for (int64_t ob = begin; ob < end; ++ob) block<M, NB>(w, x, ldx, k, kb_size, ob, bias, y, n);
  });
}

// Past kMaxRows the accumulators of every row no longer fit the 32 vector registers, so rows go
// in groups of at most kGroupRows (6 rows x 4 vectors of a 64-output block = 24 accumulators,
// with the block's 4 weight vectors beside them), and the groups take the weight block in chunks
// of kChunkPairs input pairs (16 KiB at 64 outputs): the first group streams a chunk in from
// memory, the others find it in L1, and each group prefetches its share of the next chunk into
// L2 meanwhile. A row's fp32 sums wait in `acc` between chunks; each output still adds its input
// pairs in order 0, 1, 2, ..., as `block` does, so both kernels give the same bits for a row.
// Why: from 9 to 64 rows (decode batches) oneDNN ran these products at 0.5-0.75 of the
// VDPBF16PS peak once the weights stream from memory, and the engine's step ran its layers in
// Python because this kernel took no more than 8 rows. builtin:small's 12 layers and vocabulary
// projection, 2 Zen 5 cores, weights streamed from memory: 9 rows 4.5 ms against oneDNN's 5.7,
// 16 rows 4.9-5.0 against 6.7-6.9, 32 rows 7.9-8.0 against 10.0-10.7, 48 rows 10.8 against 13.2,
// 64 rows 15.2-15.9 against 16.6-17.2. The prefetch matters: spread evenly over a group's pairs
// (the last lines asked for just before the next chunk needs them) 32 rows took 9.9 ms and 64
// rows 17.4-18.2; asked for from the group's first pairs on, as here, 7.9 and 15.2-15.9 (the
// same loop, alternating). One layer's weight hot in cache: ~900 GFLOP/s at 32 rows against
// oneDNN's 830.
constexpr int kGroupRows = 6;
constexpr int64_t kChunkPairs = 64;

// acc [R rows][NB] += x rows [R][pairs j0..j1) . block's pairs j0..j1; `first`: acc starts at 0.
template <int R, int NB>
inline void group_chunk(const uint16_t* block_w, const uint16_t* x, int64_t ldx, int64_t j0, int64_t j1, float* acc,
                        bool first, const char* prefetch, int64_t prefetch_lines) {
  constexpr int NV = NB / 16;
  __m512 a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) a[r][v] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + r * NB + 16 * v);
  // This group's share of the next chunk, `per_pair` lines with each pair, into L2 (current
  // and next chunk together would not fit L1).
  const int64_t per_pair = (prefetch_lines + (j1 - j0) - 1) / (j1 - j0);
  for (int64_t j = j0, line = 0; j < j1; ++j) {
    for (const int64_t stop = std::min(prefetch_lines, line + per_pair); line < stop; ++line)
      _mm_prefetch(prefetch + line * 64, _MM_HINT_T1);
    __m512bh wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(block_w + j * 2 * NB + 32 * v);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      __builtin_memcpy(&pair, x + r * ldx + 2 * j, sizeof(pair));
      const __m512bh xp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int v = 0; v < NV; ++v) a[r][v] = _mm512_dpbf16_ps(a[r][v], wv[v], xp);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) _mm512_store_ps(acc + r * NB + 16 * v, a[r][v]);
}

// y [m, n] = x [m, k] W^T (+ bias) for kMaxRows < m <= kMaxTiledRows. Block ob's tiles lie one
// after another, so its input pair p is at ob * k * NB + 2 * p * NB whatever the tile size.
template <int NB>
void run_tiled(const uint16_t* w, const uint16_t* x, int64_t ldx, int64_t m, int64_t k, int64_t n, const float* bias,
               uint16_t* y) {
  const int64_t groups = (m + kGroupRows - 1) / kGroupRows;  // rows split as evenly as they go
  const int64_t pairs = k / 2;
  for_blocks(n / NB, std::max(1, 128 / NB), [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kMaxTiledRows * NB];
    for (int64_t ob = begin; ob < end; ++ob) {
      const uint16_t* block_w = w + ob * k * NB;
      for (int64_t j0 = 0; j0 < pairs; j0 += kChunkPairs) {
        const int64_t j1 = std::min(pairs, j0 + kChunkPairs);
        // Every group fetches its share of the next chunk (or block: blocks lie one after
        // another) while it computes on this one, so the next chunk's first group finds it in cache.
        const int64_t next_pairs =
            j1 < pairs ? std::min(kChunkPairs, pairs - j1) : (ob + 1 < end ? std::min(kChunkPairs, pairs) : 0);
        const int64_t lines = next_pairs * 2 * NB * 2 / 64, share = lines / groups;
        const char* next = reinterpret_cast<const char*>(block_w + j1 * 2 * NB);
        for (int64_t g = 0, r0 = 0; g < groups; ++g) {
          const int64_t rows = m / groups + (g < m % groups ? 1 : 0);
          const uint16_t* xg = x + r0 * ldx;
          float* ag = acc + r0 * NB;
          const int64_t my_lines = g + 1 == groups ? lines - g * share : share;
          switch (rows) {
#define PDSERVE_GROUP(R) \
  case R: group_chunk<R, NB>(block_w, xg, ldx, j0, j1, ag, j0 == 0, next + g * share * 64, my_lines); break;
            PDSERVE_GROUP(1) PDSERVE_GROUP(2) PDSERVE_GROUP(3) PDSERVE_GROUP(4) PDSERVE_GROUP(5) PDSERVE_GROUP(6)
#undef PDSERVE_GROUP
          }
          r0 += rows;
        }
      }
      for (int64_t r = 0; r < m; ++r)
        for (int v = 0; v < NB / 16; ++v)
          store_outputs(_mm512_load_ps(acc + r * NB + 16 * v), bias, ob * NB + 16 * v, y + r * n);
    }
  });
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define PDSERVE_INT8_GEMV 1
// An int8 weight (kernels/packed_linear.py quantize_int8: a draft model's products, where
// speculative.draft_quantization asks): one uint8 buffer of [N / 64 blocks][K / 4 groups][64
// outputs][4 inputs] int8 weights (symmetric, one scale per output), then N fp32 scales, then N
// int32 sums of each output's weights. Each row of x is quantized on the fly to 8 bits (one
// scale per row: max |x| / 127, rounded to nearest even, stored + 128 as unsigned), and
// VPDPBUSD adds 4 products of an unsigned x byte by a signed weight byte into each int32 lane:
// 64 multiply-adds per 64 weight bytes, where VDPBF16PS does 32 per 64 bytes of a bf16 weight.
// The + 128 is taken back with the weight sums: sum (q + 128) w = sum q w + 128 sum w.
// Why: a draft's guesses are worth their cost only when a guess costs far less than a target
// step, and beside the target's weights the draft's bf16 ones no longer fit the L3 (Zen 4, 32
// MiB: a 4-guess proposal 0.54-0.74 ms alone, 0.91-1.0 in turn with the target); int8 halves
// what it streams. Exact integer sums, so a row's result does not depend on the other rows.
constexpr int kInt8Block = 64;  // outputs per block: 4 vectors of 16 int32 lanes
constexpr int kInt8RowGroup = 8;  // rows whose sums stay in registers together

template <int M>
inline void int8_block(const int8_t* w, const uint8_t* xq, int64_t k, int64_t ob, const float* w_scale,
                       const int32_t* w_sum, const float* x_scale, const float* bias, uint16_t* y, int64_t ldy) {
  __m512i acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_setzero_si512();
  const int8_t* block = w + ob * k * kInt8Block;
  for (int64_t g = 0; g < k / 4; ++g) {
    __m512i wv[4];
    for (int v = 0; v < 4; ++v) wv[v] = _mm512_loadu_si512(block + g * 4 * kInt8Block + 64 * v);
    for (int m = 0; m < M; ++m) {
      int32_t four;
      __builtin_memcpy(&four, xq + m * k + 4 * g, sizeof(four));
      const __m512i xb = _mm512_set1_epi32(four);
      for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_dpbusd_epi32(acc[m][v], xb, wv[v]);
    }
  }
  for (int v = 0; v < 4; ++v) {
    const int64_t o = ob * kInt8Block + 16 * v;
    const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(w_sum + o), 7);  // 128 x the weights' sum
    const __m512 ws = _mm512_loadu_ps(w_scale + o);
    for (int m = 0; m < M; ++m) {
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][v], offset));
      store_outputs(_mm512_mul_ps(sums, _mm512_mul_ps(ws, _mm512_set1_ps(x_scale[m]))), bias, o, y + m * ldy);
    }
  }
}

// A row of x (bf16, K a multiple of 4) as unsigned bytes q + 128 into xq [K], q = x / scale
// rounded to nearest even (the default rounding of VCVTPS2DQ) within [-127, 127]; returns the
// scale, max |x| / 127 (1 for a row of zeros).
inline float quantize_row(const uint16_t* x, int64_t k, uint8_t* xq) {
  auto widen = [](const uint16_t* p) {  // 16 bf16 -> fp32: the bits shifted into the high half
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(p))), 16));
  };
  auto scalar = [](uint16_t b) {
    const uint32_t bits = static_cast<uint32_t>(b) << 16;
    float v;
    __builtin_memcpy(&v, &bits, sizeof(v));
    return v;
  };
  const int64_t k16 = k - k % 16;
  __m512 m16 = _mm512_setzero_ps();
  for (int64_t i = 0; i < k16; i += 16) m16 = _mm512_max_ps(m16, _mm512_abs_ps(widen(x + i)));
  float amax = _mm512_reduce_max_ps(m16);
  for (int64_t i = k16; i < k; ++i) amax = std::max(amax, std::fabs(scalar(x[i])));
  const float scale = amax > 0.f ? amax / 127.f : 1.f;
  const float inv = 1.f / scale;
  const __m512 inv16 = _mm512_set1_ps(inv);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), bias = _mm512_set1_epi32(128);
  for (int64_t i = 0; i < k16; i += 16) {
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(widen(x + i), inv16));
    q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), bias);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i), _mm512_cvtepi32_epi8(q));
  }
  for (int64_t i = k16; i < k; ++i) {
    const float q = std::min(127.f, std::max(-127.f, std::nearbyint(scalar(x[i]) * inv)));
    xq[i] = static_cast<uint8_t>(static_cast<int>(q) + 128);
  }
  return scale;
}

void run_int8(const uint8_t* buffer, const uint16_t* x, int64_t ldx, int64_t m, int64_t k, int64_t n,
              const float* bias, uint16_t* y) {
  const auto* w = reinterpret_cast<const int8_t*>(buffer);
  const auto* w_scale = reinterpret_cast<const float*>(buffer + n * k);
  const auto* w_sum = reinterpret_cast<const int32_t*>(buffer + n * k + 4 * n);
  std::vector<uint8_t> xq(m * k);
  std::vector<float> x_scale(m);
  for (int64_t r = 0; r < m; ++r) x_scale[r] = quantize_row(x + r * ldx, k, xq.data() + r * k);
  for (int64_t r0 = 0; r0 < m; r0 += kInt8RowGroup) {
    const int64_t rows = std::min<int64_t>(kInt8RowGroup, m - r0);
    const uint8_t* xg = xq.data() + r0 * k;
    const float* sg = x_scale.data() + r0;
    uint16_t* yg = y + r0 * n;
    for_blocks(n / kInt8Block, 2, [&](int64_t begin, int64_t end) {
      for (int64_t ob = begin; ob < end; ++ob) {
        switch (rows) {
#define PDSERVE_INT8_ROWS(M) \
  case M: int8_block<M>(w, xg, k, ob, w_scale, w_sum, sg, bias, yg, n); break;
          PDSERVE_INT8_ROWS(1) PDSERVE_INT8_ROWS(2) PDSERVE_INT8_ROWS(3) PDSERVE_INT8_ROWS(4)
          PDSERVE_INT8_ROWS(5) PDSERVE_INT8_ROWS(6) PDSERVE_INT8_ROWS(7) PDSERVE_INT8_ROWS(8)
#undef PDSERVE_INT8_ROWS
        }
      }
    });
  }
}
#else
#define PDSERVE_INT8_GEMV 0
#endif

#if PDSERVE_AMX
// Rows of x whose products take each weight block in turn while it is in L2: a 32-output block
// is K x 64 bytes (128 KiB at K = 2,048), read from memory once per chunk, not per 32 rows.
constexpr int64_t kAmxChunkRows = 128;
constexpr int64_t kAmxGrain = 4;  // output blocks per pull: a run of W streamed front to back

// One 32-row block of x (`rows` <= 32, as the tiles are configured) by output block `tile`
// (its K / 32 weight tiles, one after another) into c [rows][32] fp32. Tiles: 0-1 C of rows
// 0-15 (outputs 0-15, 16-31), 2-3 C of rows 16-31, 4-5 A of those row groups, 6-7 B (the
// weight tile's two halves).
inline void amx_block(const uint16_t* tile, const uint16_t* x, int64_t ldx, int rows, int64_t k, float (*c)[32]) {
  const int64_t x_stride = ldx * sizeof(uint16_t);
  const bool two = rows > 16;
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < k; kb += 32, tile += 32 * 32) {
    // The weight tile kPrefetchTiles ahead, line by line (the stream crosses output blocks).
    for (int line = 0; line < 32; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(tile + kPrefetchTiles * 32 * 32 + line * 32), _MM_HINT_T0);
    _tile_loadd(6, tile, 128);
    _tile_loadd(7, tile + 32, 128);
    _tile_loadd(4, x + kb, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, x + 16 * ldx + kb, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c[0], 32 * sizeof(float));
  _tile_stored(1, c[0] + 16, 32 * sizeof(float));
  if (two) {
    _tile_stored(2, c[16], 32 * sizeof(float));
    _tile_stored(3, c[16] + 16, 32 * sizeof(float));
  }
}

// y [m, n] = x [m, k] W^T (+ bias) over AMX-layout 32 x 32 weight tiles, for any m: each weight
// tile is two AMX B tiles as it lies (16 input pairs x 16 outputs, rows 128 bytes apart), x is
// the A tile as it lies (16 rows x 32 inputs), so nothing is repacked. A pull is a chunk of
// kAmxChunkRows rows by kAmxGrain output blocks; at m <= 32 (decode) that is a run of W.
// Why past 32 rows (prefill chunks): oneDNN's own kernel for the same packed weight ran the
// 768-output layers of builtin:small at ~0.95 TFLOP/s at 512 and 1,024 rows (2 Sapphire
// Rapids-class cores), against 1.5-2.2 for the other shapes (`benchmarks/gemm_shapes.py
// --by-shape`; kernels/packed_linear.py AMX_PREFILL_ROWS has the figures).
void run_amx(const uint16_t* w, const uint16_t* x, int64_t ldx, int64_t m, int64_t k, int64_t n, const float* bias,
             uint16_t* y) {
  const int64_t col_blocks = n / 32;
  const int64_t runs = (col_blocks + kAmxGrain - 1) / kAmxGrain;
  const int64_t chunks = (m + kAmxChunkRows - 1) / kAmxChunkRows;
  for_blocks(chunks * runs, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float c[32][32];  // one block's fp32 products, rows x outputs, before rounding
    int configured = 0;           // rows the tiles are configured for (LDTILECFG only on a change)
    for (int64_t pull = begin; pull < end; ++pull) {
      const int64_t r_end = std::min(m, (pull / runs + 1) * kAmxChunkRows);
      const int64_t ob0 = (pull % runs) * kAmxGrain, ob1 = std::min(col_blocks, ob0 + kAmxGrain);
      for (int64_t r0 = (pull / runs) * kAmxChunkRows; r0 < r_end; r0 += 32) {
        const int rows = static_cast<int>(std::min<int64_t>(32, r_end - r0));
        if (rows != configured) {
          const auto m0 = static_cast<uint8_t>(std::min(rows, 16)), m1 = static_cast<uint8_t>(rows - m0);
          const uint8_t tile_rows[8] = {m0, m0, m1, m1, m0, m1, 16, 16};
          pdserve::configure_amx_tiles(tile_rows);
          configured = rows;
        }
        for (int64_t ob = ob0; ob < ob1; ++ob) {
          amx_block(w + ob * k * 32, x + r0 * ldx, ldx, rows, k, c);
          for (int64_t r = 0; r < rows; ++r) {
            store_outputs(_mm512_load_ps(c[r]), bias, ob * 32, y + (r0 + r) * n);
            store_outputs(_mm512_load_ps(c[r] + 16), bias, ob * 32 + 16, y + (r0 + r) * n);
          }
        }
      }
    }
    if (configured) _tile_release();
  });
}
#endif

}  // namespace

bool packed_gemv_amx_supported() {
#if PDSERVE_AMX
  return pdserve::amx_ready();
#else
  return false;
#endif
}

bool int8_gemv_supported() {
  return PDSERVE_INT8_GEMV != 0;
}

bool packed_gemv_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// The bias as both kernels add it: fp32, contiguous, to the fp32 sums before they are rounded
// (undefined where there is none).
static at::Tensor float_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, "bias must hold N = ", n, " values, got ", bias->numel());
  return bias->to(at::kFloat).contiguous();
}

// y = x W^T (+ b) for a weight in quantize_int8's buffer (run_int8); packed_gemv sends a uint8
// `blocked` here, so the fused layers take an int8 weight where a bf16 one would go.
at::Tensor int8_gemv(at::Tensor x, at::Tensor buffer, int64_t n, c10::optional<at::Tensor> bias, int64_t block_n,
                     int64_t block_k) {
  TORCH_CHECK(int8_gemv_supported(), "int8 weights need a CPU with AVX512-VNNI and AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "int8_gemv takes bf16 x [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(block_n == 64 && block_k == 4, "int8 weights lie in blocks of 64 outputs x 4 inputs, got ", block_n,
              " x ", block_k);
  TORCH_CHECK(n % 64 == 0 && k % 4 == 0 && buffer.is_contiguous() && buffer.numel() == n * k + 8 * n,
              "an int8 weight buffer holds N x K weights, N scales and N sums (N a multiple of 64, K of 4)");
  if (x.stride(1) != 1) x = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  const at::Tensor bias_f = float_bias(bias, n);
#if PDSERVE_INT8_GEMV
  run_int8(buffer.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0),
           m, k, n, bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
           reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
#endif
  return y;
}

at::Tensor packed_gemv(at::Tensor x, at::Tensor blocked, int64_t n, c10::optional<at::Tensor> bias, int64_t block_n,
                       int64_t block_k) {
  TORCH_CHECK(packed_gemv_supported(), "packed_gemv needs a CPU with AVX512-BF16");
  if (blocked.scalar_type() == at::kByte) return int8_gemv(x, blocked, n, bias, block_n, block_k);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && blocked.scalar_type() == at::kBFloat16,
              "packed_gemv takes bf16 x [M, K] and a bf16 blocked weight");
  const int64_t m = x.size(0), k = x.size(1);
  const bool amx = block_n == 32 && block_k == 32 && packed_gemv_amx_supported();
  TORCH_CHECK(m >= 1 && (amx || m <= kMaxTiledRows), "packed_gemv serves 1 to ", kMaxTiledRows,
              " rows here without AMX, got ", m);
  TORCH_CHECK(block_n == 32 || block_n == 64, "packed_gemv reads blocks of 32 or 64 outputs, got ", block_n);
  TORCH_CHECK(block_k > 0 && block_k % 2 == 0 && k % block_k == 0, "block_k must be even and divide K");
  TORCH_CHECK(n % block_n == 0 && blocked.numel() == n * k && blocked.is_contiguous(),
              "the blocked weight must hold N x K elements, N a multiple of the block");
  if (x.stride(1) != 1) x = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  const at::Tensor bias_f = float_bias(bias, n);
#if defined(__AVX512BF16__)
  const auto* w = reinterpret_cast<const uint16_t*>(blocked.data_ptr<at::BFloat16>());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  (void)amx;
#if PDSERVE_AMX
  if (amx) {
    run_amx(w, xp, x.stride(0), m, k, n, bp, yp);
    return y;
  }
#endif
  auto rows = [&](auto nb) {
    constexpr int NB = decltype(nb)::value;
    if (m > kMaxRows) return run_tiled<NB>(w, xp, x.stride(0), m, k, n, bp, yp);
    switch (m) {
#define PDSERVE_ROWS(M) \
  case M: run<M, NB>(w, xp, x.stride(0), k, block_k, n, bp, yp); break;
      PDSERVE_ROWS(1) PDSERVE_ROWS(2) PDSERVE_ROWS(3) PDSERVE_ROWS(4)
      PDSERVE_ROWS(5) PDSERVE_ROWS(6) PDSERVE_ROWS(7) PDSERVE_ROWS(8)
#undef PDSERVE_ROWS
    }
  };
  if (block_n == 32)
    rows(std::integral_constant<int, 32>{});
  else
    rows(std::integral_constant<int, 64>{});
#endif
  return y;
}
