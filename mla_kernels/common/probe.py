"""A minimal kernel that exercises the package's compile pipeline on any arch.

It uses the pieces every real kernel relies on -- an smem struct, an mbarrier, a named barrier,
fake tensors with symbolic extents and TVM-FFI -- so ``tools/compile_report.py`` and the CPU tests
can prove the pipeline for an arch that has no real kernel yet (sm_100a until the Blackwell
kernels land).  It computes ``y[i] = 2 * x[i]`` through shared memory.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

THREADS = 128


class PipelineProbe:
    """``y = 2 x`` (float32), one 128-element tile per CTA, staged through smem."""

    def __init__(self):
        self.smem_bytes = 0

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, stream):
        @cute.struct
        class SharedStorage:
            buf: cute.struct.Align[cute.struct.MemRange[Float32, THREADS], 16]
            mbar: cute.struct.MemRange[cutlass.Int64, 1]

        self.smem_bytes = SharedStorage.size_in_bytes()
        n = mX.shape[0]
        self.kernel(mX, mY, SharedStorage).launch(
            grid=[(n + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], smem=self.smem_bytes, stream=stream
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mY: cute.Tensor, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        buf = storage.buf.get_tensor(cute.make_layout(THREADS))
        mbar = storage.mbar.data_ptr()
        if tidx == 0:
            cute.arch.mbarrier_init(mbar, THREADS)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        i = bidx * THREADS + tidx
        n = mX.shape[0]
        v = Float32(0.0)
        if i < n:
            v = mX[i]
        buf[tidx] = v * Float32(2.0)
        cute.arch.mbarrier_arrive(mbar)
        cute.arch.mbarrier_wait(mbar, 0)
        cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)
        if i < n:
            mY[i] = buf[tidx]


def compile_probe(arch: str, **kw):
    """Compile :class:`PipelineProbe` for ``arch`` (no GPU needed); returns (kernel, compiled)."""
    from .. import _compile
    from . import host

    k = PipelineProbe()
    n = cute.sym_int()
    compiled = _compile.compile_kernel(
        k, host.fake(Float32, (n,), align=4), host.fake(Float32, (n,), align=4), host.fake_stream(), arch=arch, **kw
    )
    return k, compiled
