#!/usr/bin/env python3
"""Scatter-add microbenchmark: the sparse backward's dKV traffic pattern in isolation (GPU only).

  python tools/atomic_bench.py [--s-kv 8192,32768] [--d 576] [--updates 4194304] [--ctas-per-sm 1,2,8]

``--updates`` random rows (uniform over ``s_kv``) of a float32 ``[s_kv, d]`` workspace each get one
``d``-float row added, by three mechanisms, with the values generated in registers/smem (no source
traffic), so the time is the reduction path alone:

* ``red.v4``   -- per warp instruction 4 rows x one 128-byte line, 16-byte ``red.global.add.v4.f32``
  with an L2 evict_last hint: what the sm90 backward's scatter issues;
* ``bulk-row`` -- one TMA bulk reduction (``cp.reduce.async.bulk .add.f32``) per whole row from a
  shared-memory copy of the row, issued by one lane per warp;
* ``bulk-256`` -- the same in 256-byte pieces (one 64-column chunk of a row, as a chunked epilogue
  would issue them).

Prints GB/s of added data (``updates * d * 4`` bytes) per mechanism and size: the ceiling the
backward's dKV atomics run into (38.7 GB at s_q 4096, h_q 128, topk 2048, d 576).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32, Int64  # noqa: E402

from mla_kernels.common import device as dev  # noqa: E402

THREADS = 128
MODES = ("red.v4", "bulk-row", "bulk-256")


class ScatterAdd:
    def __init__(self, d: int, mode: str):
        assert d % 32 == 0 and mode in MODES
        self.d = d
        self.mode = mode

    @cute.jit
    def __call__(self, mWs: cute.Tensor, mIdx: cute.Tensor, n_ctas: Int32, stream):
        d = self.d

        @cute.struct
        class Smem:
            row: cute.struct.Align[cute.struct.MemRange[Float32, d], 128]

        self.kernel(mWs, mIdx, Smem).launch(grid=[n_ctas, 1, 1], block=[THREADS, 1, 1],
                                            smem=Smem.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, mWs: cute.Tensor, mIdx: cute.Tensor, Smem: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        lane = tidx % 32
        warp = tidx // 32
        d = self.d
        n = mIdx.shape[0]
        policy = dev.createpolicy_evict_last()
        base = dev.gmem_addr_i64(mWs.iterator)
        row_bytes = d * 4
        val = Float32(1.0)
        if const_expr_mode(self.mode, "red.v4"):
            # warp w of CTA c takes updates 4 k .. 4 k + 3 for k = c * 4 + w, step 4 * grid
            sub = lane // 8
            col_b = (lane % 8) * 16
            n4 = n // 4
            for k in cutlass.range(bidx * 4 + warp, n4, nblk * 4, unroll=1):
                row = Int64(mIdx[4 * k + sub])
                a = base + row * Int64(row_bytes) + Int64(col_b)
                for line in cutlass.range_constexpr(d // 32):
                    dev.red_add_v4_f32_hint(a + Int64(line * 128), val, val, val, val, policy)
        else:
            smem = cutlass.memory.SmemAllocator()
            st = smem.allocate(Smem)
            srow = st.row.get_tensor(cute.make_layout(d))
            for c in cutlass.range(tidx, d, THREADS, unroll=1):
                srow[c] = Float32(1.0)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            saddr = dev.smem_addr_u32(st.row.data_ptr())
            if lane == 0:
                piece = row_bytes if const_expr_mode(self.mode, "bulk-row") else 256
                for u in cutlass.range(bidx * 4 + warp, n, nblk * 4, unroll=1):
                    row = Int64(mIdx[u])
                    a = base + row * Int64(row_bytes)
                    for off in cutlass.range_constexpr(0, row_bytes, piece):
                        dev.bulk_reduce_add_f32(a + Int64(off), saddr + off, Int32(piece), policy)
                    dev.bulk_commit_and_wait_read_le(8)
                dev.bulk_commit_and_wait_read_le(0)


def const_expr_mode(mode, want):
    return cutlass.const_expr(mode == want)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--s-kv", default="8192,32768", help="comma-separated workspace row counts")
    ap.add_argument("--d", type=int, default=576, help="row width in floats (a multiple of 32)")
    ap.add_argument("--updates", type=int, default=1 << 22, help="row updates per timed launch")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ctas-per-sm", default="8",
                    help="comma-separated grid sizes in CTAs (of 128 threads) per SM: how many warps issue at once; "
                         "a fraction < 1 leaves SMs idle (0.5: one CTA on half of the SMs)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("atomic_bench: needs a CUDA GPU")
        return 2
    from mla_kernels import _compile

    arch = _compile.arch_for_device(torch.device("cuda"))
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"GPU: {torch.cuda.get_device_name()}; d {args.d}; {args.updates} row updates per launch "
          f"({args.updates * args.d * 4 / 1e9:.2f} GB added)")
    from mla_kernels.common import host

    for mode in args.modes.split(","):
        if mode not in MODES:
            ap.error(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        k = ScatterAdd(args.d, mode)
        fn = _compile.compile_kernel(
            k, host.fake(Float32, (cute.sym_int(), args.d)), host.fake(Int32, (cute.sym_int(),), align=4),
            Int32(1), host.fake_stream(), arch=arch)
        for s_kv, per_sm in ((int(x), float(c)) for x in args.s_kv.split(",") for c in args.ctas_per_sm.split(",")):
            ws = torch.zeros(s_kv, args.d, device="cuda")
            idx = torch.randint(0, s_kv, (args.updates,), device="cuda", dtype=torch.int32)
            n_ctas = max(1, int(sm * per_sm))
            fn(ws, idx, n_ctas)
            torch.cuda.synchronize()
            ws.zero_()
            times = []
            for _ in range(args.reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn(ws, idx, n_ctas)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            # check: every element of a row got 1.0 per time the row was picked, per launch
            cnt = torch.bincount(idx.long(), minlength=s_kv).float() * args.reps
            ok = torch.allclose(ws[:, 0], cnt, rtol=1e-4) and torch.allclose(ws[:, -1], cnt, rtol=1e-4)
            ms = statistics.median(times)
            gbs = args.updates * args.d * 4 / ms / 1e6
            print(f"{mode:<9} s_kv {s_kv:>6} (workspace {s_kv * args.d * 4 / 2**20:6.1f} MiB), {n_ctas} CTAs: "
                  f"{ms:7.3f} ms  {gbs:7.1f} GB/s  check {'ok' if ok else 'WRONG'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
