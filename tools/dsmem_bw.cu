// DSMEM exchange microbenchmark: how fast can the CTAs of one thread-block cluster move a split
// combine's partials between their shared memories, by instruction kind?  (Issue 16: the decode
// cluster merge, common/cluster_merge.py, pulls each CTA's slice of the heads from every peer with
// 16-byte ld.shared::cluster loads; docs/PERF.md's decode chapter measured ~25 GB/s per SM for that.)
//
// Every CTA (256 threads, one per SM: ~200 KB of dynamic shared memory) owns B bytes of "partial"
// and receives B bytes: B / n from each of the n CTAs of its cluster (itself included), as the
// merge does.  One iteration = cluster barrier, the exchange, the received bytes summed by the
// threads, cluster barrier -- the merge's shape -- repeated `iters` times in one launch.
//
//   pull      256 threads, 16-byte ld.shared::cluster.v4 from each peer's partial (today's merge);
//   bulk1     thread 0 pushes B / n to each peer: one cp.async.bulk.shared::cluster.shared::cta per
//             peer, completing bytes on the peer's mbarrier; the receiver waits, then reads locally;
//   bulkn     the same copies, lane p of warp 0 issuing peer p's (n lanes issue at once);
//   stasync   256 threads, 16-byte st.async ... mbarrier::complete_tx into the peers' shared memory;
//   local     every thread reads its own CTA's bytes only (the barriers and the local reads: the
//             floor the exchange sits on).
//
// Build: nvcc -O3 -arch=sm_90a -std=c++17 tools/dsmem_bw.cu -o /tmp/dsmem_bw
// Run:   /tmp/dsmem_bw              (cluster sizes 2..16, B = 32 / 64 KB, every mode; median of 11
//        launches; prints us per iteration and GB/s received per SM)
// A measurement tool (docs/PERF.md, the decode chapter), not part of the package.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_tool.cuh"

enum Mode { PULL = 0, BULK1 = 1, BULKN = 2, STASYNC = 3, LOCAL = 4 };
static const char* kModeName[] = {"pull", "bulk1", "bulkn", "stasync", "local"};

constexpr int THREADS = 256;
constexpr int MAXB = 64 * 1024;
constexpr int SMEM = 2 * MAXB + 64 * 1024;  // src, dst, and padding that keeps one CTA per SM

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t mapa(uint32_t a, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void mb_expect(uint32_t b, uint32_t tx) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(tx) : "memory");
}
__device__ __forceinline__ void mb_wait(uint32_t b, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}\n" ::"r"(b),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ uint4 ld_cluster_v4(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared::cluster.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(a)
               : "memory");
  return v;
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a) : "memory");
  return v;
}
__device__ __forceinline__ void bulk_s2c(uint32_t dst_cluster, uint32_t src_cta, uint32_t bytes, uint32_t mbar_cluster) {
  asm volatile(
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst_cluster),
      "r"(src_cta), "r"(bytes), "r"(mbar_cluster)
      : "memory");
}
__device__ __forceinline__ void st_async_v4(uint32_t dst_cluster, uint4 v, uint32_t mbar_cluster) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(dst_cluster),
      "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(mbar_cluster)
      : "memory");
}

template <int KB>
__global__ void __launch_bounds__(THREADS, 1) dsmem_kernel(int mode, int n, int iters, uint32_t* sink) {
  constexpr int bytes = KB * 1024;
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ __align__(8) uint64_t mbar;
  uint8_t* src = smem;
  uint8_t* dst = smem + MAXB;
  const int tid = threadIdx.x;
  const uint32_t rank = cluster_rank();
  const uint32_t src_a = sa(src), dst_a = sa(dst), bar_a = sa(&mbar);
  for (int i = tid * 16; i < bytes; i += THREADS * 16) {
    *reinterpret_cast<uint4*>(src + i) = make_uint4(rank + i, i, 3 * i, blockIdx.x);
  }
  if (tid == 0) {
    mb_init(bar_a, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  cluster_sync();

  const int slice = bytes / n;                  // bytes from each peer
  uint32_t acc = 0;
  for (int it = 0; it < iters; ++it) {
    if (mode != PULL && mode != LOCAL && tid == 0) mb_expect(bar_a, bytes);
    cluster_sync();
    if (mode == PULL || mode == LOCAL) {
      // every chunk's address first, then all loads, then the sums: no load waits on another
      constexpr int CH = KB * 1024 / (THREADS * 16);  // 16-byte chunks per thread
      uint4 v[CH];
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        const int k = c * THREADS + tid;  // chunk index over the B received bytes
        const int p = k / (slice / 16), off = (k % (slice / 16)) * 16;
        const uint32_t a = src_a + rank * slice + off;  // my slice of peer p's partial
        v[c] = mode == PULL ? ld_cluster_v4(mapa(a, p)) : ld_shared_v4(a);
      }
#pragma unroll
      for (int c = 0; c < CH; ++c) acc += v[c].x ^ v[c].y ^ v[c].z ^ v[c].w;
    } else {
      if (mode == BULK1 && tid == 0) {
        for (int p = 0; p < n; ++p) {
          bulk_s2c(mapa(dst_a + rank * slice, p), src_a + p * slice, slice, mapa(bar_a, p));
        }
      } else if (mode == BULKN && tid < n) {
        bulk_s2c(mapa(dst_a + rank * slice, tid), src_a + tid * slice, slice, mapa(bar_a, tid));
      } else if (mode == STASYNC) {
        for (int p = 0; p < n; ++p) {
          const uint32_t rd = mapa(dst_a + rank * slice, p), rbar = mapa(bar_a, p);
          for (int off = tid * 16; off < slice; off += THREADS * 16) {
            st_async_v4(rd + off, ld_shared_v4(src_a + p * slice + off), rbar);
          }
        }
      }
      mb_wait(bar_a, it & 1);
      constexpr int CH = KB * 1024 / (THREADS * 16);
      uint4 v[CH];
#pragma unroll
      for (int c = 0; c < CH; ++c) v[c] = ld_shared_v4(dst_a + (c * THREADS + tid) * 16);
#pragma unroll
      for (int c = 0; c < CH; ++c) acc += v[c].x ^ v[c].y ^ v[c].z ^ v[c].w;
    }
    cluster_sync();
  }
  if (acc == 0x12345678u) sink[blockIdx.x * THREADS + tid] = acc;  // keeps the loads live
}

int main() {
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  for (auto f : {dsmem_kernel<32>, dsmem_kernel<64>}) {
    CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
    CK(cudaFuncSetAttribute(f, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  }
  uint32_t* sink;
  CK(cudaMalloc(&sink, sizeof(uint32_t) * THREADS * sms));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const int iters = 200;
  std::printf("%s, %d SMs; %d iterations per launch, median of 11 launches\n", prop.name, sms, iters);
  std::printf("%-4s %-6s %-8s %-9s %-12s %-14s\n", "n", "KB", "clusters", "mode", "us/iter", "GB/s per SM");
  for (int n : {2, 4, 8, 16}) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = n;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = SMEM;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    cfg.gridDim = dim3(n);
    int clusters = 0;
    CK(cudaOccupancyMaxActiveClusters(&clusters, dsmem_kernel<64>, &cfg));
    cfg.gridDim = dim3(n * clusters);
    for (int kb : {32, 64}) {
      const int bytes = kb * 1024;
      for (int mode = 0; mode < 5; ++mode) {
        std::vector<float> t;
        for (int r = 0; r < 12; ++r) {
          CK(cudaEventRecord(e0));
          if (kb == 32) CK(cudaLaunchKernelEx(&cfg, dsmem_kernel<32>, mode, n, iters, sink));
          else CK(cudaLaunchKernelEx(&cfg, dsmem_kernel<64>, mode, n, iters, sink));
          CK(cudaEventRecord(e1));
          CK(cudaEventSynchronize(e1));
          float ms;
          CK(cudaEventElapsedTime(&ms, e0, e1));
          if (r) t.push_back(ms);
        }
        std::sort(t.begin(), t.end());
        const double us = t[t.size() / 2] * 1e3 / iters;
        std::printf("%-4d %-6d %-8d %-9s %-12.3f %-14.1f\n", n, kb, clusters, kModeName[mode], us, bytes / us * 1e-3);
      }
    }
  }
  CK(cudaGetLastError());
  return 0;
}
