// Gather-alone microbenchmark: how fast can one CTA per SM move randomly indexed 1,152-byte KV
// rows (d_qk 576, bf16) from L2 into a shared-memory ring of 64-row blocks, by instruction kind?
//
//   A  "ldgsts": 128 producer threads, 16-byte cp.async.cg (L2::256B) per chunk into the SW128
//      K-major tiles the sm90 kernels' wgmma reads (9 k-tiles of 64 x 64 bf16), one
//      cp.async.mbarrier.arrive.noinc per thread and stage -- what the sm90 kernels do today
//      (8 lanes per 128-byte row segment, 4 rows per thread, the next stage's 4 indices loaded
//      into registers one stage ahead);
//   A0 the same copies with each chunk's index loaded just before its copy (a naive producer);
//   AP A with the sm90 kernels' exact copy: an L2 evict_last cache policy and the src-size operand
//      (common/gather.py's cp.async.cg ... L2::cache_hint L2::256B); "grid=tokens": one CTA per
//      token (4096 CTAs) instead of one persistent CTA per SM, as attn_dist's tokens mode runs;
//   B  "bulk": one producer warp, one 1-D cp.async.bulk of a whole row (1,152 B) into a
//      row-contiguous stage (a layout wgmma cannot read as a K-major operand); B4: four warps
//      issuing them (16 rows each);
//   C  "tma_row": one producer warp, 9 tiled TMA copies per row (box 64 x 1, SWIZZLE_128B) into
//      the same SW128 tiles as A (the swizzle follows the shared address bits); C4: four warps.
//
// A consumer warp only waits for each stage and frees it: no math.  Bytes = tokens x topk x 1,152.
// Build: nvcc -O3 -arch=sm_90a -std=c++17 -Wno-deprecated-declarations tools/gather_bw.cu -o /tmp/gather_bw
// Run:   /tmp/gather_bw [s_kv ...]      (prints one line per variant, stages and s_kv; two interleaved
//        rounds of medians of 21 launches; GATHER_BW_NO_TMA=1 skips the slow C / C4 variants)
// A measurement tool (docs/PERF.md, the attn_dist chapter), not part of the package.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <type_traits>
#include <vector>

#include "cuda_tool.cuh"

constexpr int D = 576;
constexpr int ROW_B = D * 2;          // 1152
constexpr int BLK = 64;               // rows per stage
constexpr int STAGE_B = BLK * ROW_B;  // 73,728
constexpr int KT = D / 64;            // 9 k-tiles of 128 B per row
constexpr int TOPK = 2048;

__device__ __forceinline__ void mb_wait(uint32_t b, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}\n" ::"r"(b),
      "r"(parity));
}
__device__ __forceinline__ void mb_arrive(uint32_t b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(b));
}
__device__ __forceinline__ void mb_expect(uint32_t b, uint32_t tx) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(tx));
}

// variant: 0 = A0 naive ldgsts, 1 = B bulk rows (1 warp), 2 = C tma rows, 3 = A ldgsts, 4 = B4 bulk (4 warps),
// 5 = C4 tma rows (4 warps), 6 = AP (A + evict_last policy + src-size)
template <int VAR, int NST>
__global__ void __launch_bounds__(256, 1)
    gather_kernel(const __grid_constant__ CUtensorMap tmap, const uint8_t* __restrict__ kv,
                  const int* __restrict__ idx, int tokens, uint8_t* __restrict__ dump) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + NST * STAGE_B);
  uint64_t* empty = full + NST;
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  if (tid == 0) {
    for (int s = 0; s < NST; ++s) {
      mb_init(sa(&full[s]), (VAR == 0 || VAR == 3 || VAR == 6) ? 128 : 1);
      mb_init(sa(&empty[s]), 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  // warps 0-3: producer (A: all 128 threads; B, C: warp 0), warp 4: consumer
  int it = 0;
  if (warp < 4) {
    if ((VAR == 1 || VAR == 2) && warp != 0) return;
    // A: thread = (row r0 + 16 j, 16-byte chunk seg of each 128-byte k-tile segment); indices of
    // the next stage prefetched into registers
    const int seg = tid & 7, r0 = tid >> 3;
    int nxt[4] = {0, 0, 0, 0};
    uint64_t pol = 0;
    if (VAR == 6) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    if ((VAR == 3 || VAR == 6) && blockIdx.x < tokens)
      for (int j = 0; j < 4; ++j) nxt[j] = __ldg(idx + (size_t)blockIdx.x * TOPK + r0 + 16 * j);
    for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
      const int* ti = idx + (size_t)t * TOPK;
      for (int b = 0; b < TOPK / BLK; ++b, ++it) {
        const int s = it % NST;
        const uint32_t ph = (it / NST) & 1;
        if (it >= NST) mb_wait(sa(&empty[s]), ph ^ 1);
        uint8_t* st = smem + s * STAGE_B;
        if (VAR == 3 || VAR == 6) {
          int cur[4];
          for (int j = 0; j < 4; ++j) cur[j] = nxt[j];
          // the next stage's indices (this token's next block, or the next token's first)
          const int nb = b + 1 < TOPK / BLK ? b + 1 : 0;
          const int nt = b + 1 < TOPK / BLK ? t : t + gridDim.x;
          if (nt < tokens)
            for (int j = 0; j < 4; ++j) nxt[j] = __ldg(idx + (size_t)nt * TOPK + nb * BLK + r0 + 16 * j);
#pragma unroll
          for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const int r = r0 + 16 * j;
              const uint8_t* src = kv + (size_t)cur[j] * ROW_B + kt * 128 + seg * 16;
              const uint32_t dst = sa(st + kt * (BLK * 128) + r * 128 + ((seg ^ (r & 7)) << 4));
              if (VAR == 6)
                asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;" ::"r"(dst),
                             "l"(src), "r"(16), "l"(pol));
              else
                asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(src));
            }
          }
          asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(sa(&full[s])));
        } else if (VAR == 0) {
#pragma unroll 4
          for (int i = 0; i < (BLK * 72) / 128; ++i) {
            const int c = tid + 128 * i;
            const int r = c / 72, c16 = c % 72;
            const int row = __ldg(ti + b * BLK + r);
            const uint8_t* src = kv + (size_t)row * ROW_B + c16 * 16;
            const int kt = c16 >> 3, w = c16 & 7;
            const uint32_t dst = sa(st + kt * (BLK * 128) + r * 128 + ((w ^ (r & 7)) << 4));
            asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(src));
          }
          asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(sa(&full[s])));
        } else {
          if (lane == 0 && warp == 0) mb_expect(sa(&full[s]), STAGE_B);
          __syncwarp();
          constexpr bool four = VAR == 4 || VAR == 5;
          const int r_first = four ? warp * 16 + lane : lane;
          const int r_step = four ? 64 : 32;  // B4, C4: lanes 0-15 of each warp, one row each
          for (int r = r_first; r < BLK && (!four || lane < 16); r += r_step) {
            const int row = __ldg(ti + b * BLK + r);
            if (VAR == 1 || VAR == 4) {
              const uint8_t* src = kv + (size_t)row * ROW_B;
              asm volatile(
                  "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                      sa(st + r * ROW_B)),
                  "l"(src), "r"(ROW_B), "r"(sa(&full[s]))
                  : "memory");
            } else {
#pragma unroll
              for (int kt = 0; kt < KT; ++kt) {
                asm volatile(
                    "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
                    "[%4];" ::"r"(sa(st + kt * (BLK * 128) + r * 128)),
                    "l"(reinterpret_cast<uint64_t>(&tmap)), "r"(kt * 64), "r"(row), "r"(sa(&full[s]))
                    : "memory");
              }
            }
          }
        }
      }
    }
  } else if (warp == 4) {
    for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
      for (int b = 0; b < TOPK / BLK; ++b, ++it) {
        const int s = it % NST;
        mb_wait(sa(&full[s]), (it / NST) & 1);
        if (dump != nullptr && blockIdx.x == 0 && it == 0) {
          for (int i = lane * 16; i < STAGE_B; i += 32 * 16)
            *reinterpret_cast<uint4*>(dump + i) = *reinterpret_cast<const uint4*>(smem + s * STAGE_B + i);
        }
        __syncwarp();
        if (lane == 0) mb_arrive(sa(&empty[s]));
      }
    }
  }
}

typedef CUresult (*EncodeFn)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                             const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                             CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

template <int VAR, int NST>
float run(const CUtensorMap& tm, const uint8_t* kv, const int* idx, int tokens, int grid, uint8_t* dump, int reps) {
  const int smem = NST * STAGE_B + 1024 + 2 * NST * 8;
  auto k = gather_kernel<VAR, NST>;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  k<<<grid, 256, smem>>>(tm, kv, idx, dump ? 1 : tokens, dump);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  if (dump) return 0.f;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ts;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(e0));
    k<<<grid, 256, smem>>>(tm, kv, idx, tokens, nullptr);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    ts.push_back(ms);
  }
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

int main(int argc, char** argv) {
  std::vector<int> skvs;
  for (int i = 1; i < argc; ++i) skvs.push_back(std::atoi(argv[i]));
  if (skvs.empty()) skvs = {32768};
  const int tokens = 4096;
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  std::printf("# %s, %d SMs; tokens %d, topk %d, rows of %d B, one CTA per SM\n", prop.name, sms, tokens, TOPK,
              ROW_B);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &q));
  EncodeFn encode = reinterpret_cast<EncodeFn>(fn);
  for (int skv : skvs) {
    std::mt19937 gen(1234 + skv);
    std::uniform_int_distribution<int> ud(0, skv - 1);
    std::vector<int> hidx((size_t)tokens * TOPK);
    for (auto& v : hidx) v = ud(gen);
    std::vector<uint8_t> hkv((size_t)skv * ROW_B);
    for (size_t i = 0; i < hkv.size(); ++i) hkv[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
    uint8_t *kv, *dump;
    int* idx;
    CK(cudaMalloc(&kv, hkv.size()));
    CK(cudaMalloc(&idx, hidx.size() * 4));
    CK(cudaMalloc(&dump, STAGE_B));
    CK(cudaMemcpy(kv, hkv.data(), hkv.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(idx, hidx.data(), hidx.size() * 4, cudaMemcpyHostToDevice));
    CUtensorMap tm;
    cuuint64_t dims[2] = {(cuuint64_t)D, (cuuint64_t)skv};
    cuuint64_t strides[1] = {(cuuint64_t)ROW_B};
    cuuint32_t box[2] = {64, 1};
    cuuint32_t es[2] = {1, 1};
    CUresult cr = encode(&tm, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, kv, dims, strides, box, es,
                         CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (cr != CUDA_SUCCESS) {
      std::printf("cuTensorMapEncodeTiled failed: %d\n", (int)cr);
      return 1;
    }
    // layout checks on CTA 0's first block
    std::vector<uint8_t> hd(STAGE_B);
    auto check = [&](int var) {
      CK(cudaMemcpy(hd.data(), dump, STAGE_B, cudaMemcpyDeviceToHost));
      long bad = 0;
      for (int r = 0; r < BLK; ++r) {
        const size_t row = hidx[r];
        for (int c16 = 0; c16 < 72; ++c16) {
          size_t off = var == 1 ? (size_t)r * ROW_B + c16 * 16
                                : (size_t)(c16 >> 3) * (BLK * 128) + r * 128 + (((c16 & 7) ^ (r & 7)) << 4);
          for (int j = 0; j < 16; ++j) bad += hd[off + j] != hkv[row * ROW_B + c16 * 16 + j];
        }
      }
      return bad;
    };
    // layout check of each variant's first stage (layout: 1 row-contiguous, else SW128 tiles)
    constexpr int NV = 7;  // 0-5 as named, 6 = AP
    const char* names[NV] = {"A0 ldgsts naive", "B bulk row, 1 warp", "C tma 9/row, 1 warp", "A ldgsts(SW128)",
                             "B4 bulk row, 4 warps", "C4 tma 9/row, 4 warps", "AP ldgsts+policy"};
    const int layout[NV] = {0, 1, 0, 0, 1, 0, 0};
    long bad[NV];
    auto each = [&](auto&& f) {  // f(std::integral_constant<int, V>) for every variant V
      f(std::integral_constant<int, 0>{}), f(std::integral_constant<int, 1>{}), f(std::integral_constant<int, 2>{});
      f(std::integral_constant<int, 3>{}), f(std::integral_constant<int, 4>{}), f(std::integral_constant<int, 5>{});
      f(std::integral_constant<int, 6>{});
    };
    each([&](auto v) {
      CK(cudaMemset(dump, 0, STAGE_B));
      run<decltype(v)::value, 2>(tm, kv, idx, tokens, sms, dump, 1);
      bad[v] = check(layout[v]);
    });
    const double bytes = (double)tokens * TOPK * ROW_B;
    const int reps = 21;
    const bool with_c = std::getenv("GATHER_BW_NO_TMA") == nullptr;  // C is slow (~15 ms a run)
    auto line = [&](int round, const char* name, int stages, float ms, long mism) {
      std::printf("s_kv %6d round %d %-22s stages %d: %.3f ms  %.2f TB/s  layout mismatches %ld\n", skv, round, name,
                  stages, ms, bytes / (ms * 1e-3) / 1e12, mism);
    };
    for (int round = 0; round < 2; ++round) {  // two interleaved rounds
      float t[6][2] = {};
      for (int ns = 0; ns < 2; ++ns)
        each([&](auto v) {
          constexpr int V = decltype(v)::value;
          if (V == 6 || ((V == 2 || V == 5) && !with_c)) return;
          t[V][ns] = ns == 0 ? run<V, 2>(tm, kv, idx, tokens, sms, nullptr, reps)
                             : run<V, 3>(tm, kv, idx, tokens, sms, nullptr, reps);
        });
      for (int v = 0; v < 6; ++v)
        for (int ns = 0; ns < 2; ++ns)
          if (t[v][ns] > 0.f) line(round, names[v], ns + 2, t[v][ns], bad[v]);
      // the kernels' exact copy, and one CTA per token
      line(round, names[6], 2, run<6, 2>(tm, kv, idx, tokens, sms, nullptr, reps), bad[6]);
      line(round, "A grid=tokens", 2, run<3, 2>(tm, kv, idx, tokens, tokens, nullptr, reps), bad[3]);
      line(round, "AP grid=tokens", 2, run<6, 2>(tm, kv, idx, tokens, tokens, nullptr, reps), bad[6]);
    }
    CK(cudaFree(kv));
    CK(cudaFree(idx));
    CK(cudaFree(dump));
  }
  return 0;
}
