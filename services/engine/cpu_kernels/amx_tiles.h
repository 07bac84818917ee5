// AMX (Intel Sapphire Rapids and later): bfloat16 tiles multiplied by the core's matrix unit, for the
// projections (linear_panels.h) and the prefill attention (paged_prefill_kernels.h).
//
// TDPBF16PS C, A, B adds A x B to C: A is 16 rows of 32 bfloat16 (each 32-bit word a pair along K), B is
// 16 rows (the K pairs) of 16 words (each a pair of one output column's two K elements), C 16 x 16 float32.
// Every tile here is 16 rows of 64 bytes, so one configuration serves every use.

#pragma once

#include <cstdint>

#include "isa.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define STRATA_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#ifdef STRATA_AMX
// Linux hands out the AMX tile state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); a kernel that predates it, or a hypervisor that hides it, says no.
inline bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

// Per thread, before its first tile instruction: every tile 16 rows of 64 bytes. `_tile_release()` after.
inline void configure_tiles() {
  TileConfig config{};
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.bytes_per_row[t] = 64;
  _tile_loadconfig(&config);
}
#endif

}  // namespace
