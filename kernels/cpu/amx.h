// What every AMX kernel of kernels/cpu/ needs before its first tile instruction: the OS's
// permission for the process and a tile configuration on the thread.
//
// Included by prefill_tile_amx.h (attention) and packed_gemv.cpp (skinny products). PDSERVE_AMX
// is 1 where the build targets a CPU with AMX-BF16 (-march=native on such a CPU), else 0.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PDSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pdserve {

// Linux hands a process AMX's tile registers only once it asks (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); the first tile instruction before that is
// SIGILL. Asked once; torch's oneDNN asks the same for its own AMX kernels.
inline bool amx_ready() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Loads palette 1 on this thread: tile t has rows[t] rows of 64 bytes (0 rows: unused). A
// tile with fewer than 16 rows reads and writes only those, so a product of a few activation
// rows needs no padding.
inline void configure_amx_tiles(const uint8_t (&rows)[8]) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = rows[t] ? 64 : 0;
    cfg.rows[t] = rows[t];
  }
  // GCC does not see LDTILECFG read the struct and drops the stores above without this
  // barrier (observed with -O3: only the palette byte was written, and the load faulted).
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

}  // namespace pdserve

#else
#define PDSERVE_AMX 0
#endif
