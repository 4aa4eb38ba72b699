// Hopper wgmma helpers shared by the hand-written sm90a kernels (sparse MQA, small-M FP8 GEMM): shared-memory
// descriptors for the 128-byte swizzle, the swizzled placement of 16-byte chunks, and calls of cute's wgmma atoms
// over a register array.
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cstddef>
#include <cstdint>
#include <utility>

namespace deepinfer::wgmma {

namespace gmma = cute::SM90::GMMA;

// Byte offset of 16-byte chunk c of row r in a tile stored as column blocks of 64 rows x 128 B (128-byte swizzle):
// chunk c sits in block c / 8. Chunks c < 8 stay in the first block, which holds any number of rows.
__device__ __forceinline__ uint32_t swizzled(int r, int c) {
  return static_cast<uint32_t>((c >> 3) * (64 * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// wgmma shared-memory descriptor, 128-byte swizzle. K-major tiles: sbo = 1024 B between 8-row groups (lbo unused);
// MN-major: lbo = the bytes between 64-element column blocks, sbo = 1024 B between 8-row groups.
__device__ __forceinline__ uint64_t desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t(1) << 62) | (uint64_t(sbo >> 4) << 32) | (uint64_t(lbo >> 4) << 16) |
         static_cast<uint64_t>((saddr & 0x3ffffu) >> 4);
}

// d (+)= A B with both operands in shared memory.
template <class Atom, size_t N, size_t... I>
__device__ __forceinline__ void mma_ss(uint64_t da, uint64_t db, float (&d)[N], gmma::ScaleOut sc,
                                       std::index_sequence<I...>) {
  Atom::fma(da, db, d[I]..., sc);
}

// d += A B with A (bf16 pairs) from registers.
template <class Atom, size_t N, size_t... I>
__device__ __forceinline__ void mma_rs(const uint32_t (&a)[4], uint64_t db, float (&d)[N],
                                       std::index_sequence<I...>) {
  Atom::fma(a[0], a[1], a[2], a[3], db, d[I]..., gmma::ScaleOut::One);
}

// Keeps the compiler from moving register accesses across the asynchronous wgmma that reads / writes d.
template <size_t N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (size_t i = 0; i < N; ++i) cute::warpgroup_fence_operand(d[i]);
}

}  // namespace deepinfer::wgmma
