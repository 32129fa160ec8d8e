// Philox4x32-10 counter-based RNG (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11).
//
// The same rounds appear in hvd_terngrad/codec/terngrad_kernels.cu and in the torch reference
// (hvd_terngrad/codec/reference.py); docs/wire-format.md fixes how TernGrad builds key and counter.
#pragma once
#include <stdint.h>

#define TG_PHILOX_M0 0xD2511F53u
#define TG_PHILOX_M1 0xCD9E8D57u
#define TG_PHILOX_W0 0x9E3779B9u
#define TG_PHILOX_W1 0xBB67AE85u

static inline void tg_philox4x32_10(const uint32_t ctr_in[4], uint32_t k0, uint32_t k1, uint32_t out[4]) {
  uint32_t c0 = ctr_in[0], c1 = ctr_in[1], c2 = ctr_in[2], c3 = ctr_in[3];
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = (uint64_t)TG_PHILOX_M0 * c0;
    const uint64_t p1 = (uint64_t)TG_PHILOX_M1 * c2;
    const uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
    const uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += TG_PHILOX_W0;
    k1 += TG_PHILOX_W1;
  }
  out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}
