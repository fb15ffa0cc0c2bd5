#!/usr/bin/env python3
"""Context-parallel sparse MLA on torch.distributed: the KV sharded by token range over the ranks.

Run (GPUs, NCCL; or the CPU with gloo and the PyTorch reference)::

    torchrun --standalone --nproc-per-node 2 examples/context_parallel.py          # one GPU per rank
    torchrun --standalone --nproc-per-node 2 examples/context_parallel.py --cpu    # gloo, CPU reference

The pattern (sparse attention decomposes exactly over a split of the keys):

* every rank holds the full ``q`` (or its queries' share of a sequence-parallel layout) and the KV
  rows of one token range ``[lo, hi)`` (a paged cache: its pages of that range);
* each rank maps the global top-k indices to its local rows (``idx - lo`` inside its range, -1
  elsewhere) and runs the forward **without** ``attn_sink``: a partial ``(out_r, lse_r)``;
* ``all_gather`` the partials, ``mk.merge_attn_partials(outs, lses, attn_sink)`` (the sink is
  applied once, after the merge) -- every rank now holds the full ``out`` and ``lse``;
* backward: ``sparse_mla_bwd(q, kv_local, out, dout, local_idx, lse, ...)`` with the *merged*
  ``out`` and ``lse`` gives each rank its share: ``dkv`` of its rows (stays local), its part of
  ``dq`` (``all_reduce`` sums the shares), and -- identical on every rank -- ``d_attn_sink``;
* a decode step does the same with ``sparse_mla_decode`` on each rank's pages.

Every quantity is checked against the single-process result (the same seeded problem, the
whole KV on one rank) and printed as ``PASS``/``FAIL`` lines; the exit code is 1 on any failure.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import mla_kernels as mk  # noqa: E402


def all_gather_stack(t: torch.Tensor) -> torch.Tensor:
    """``[world, *t.shape]``: every rank's ``t`` (the list form works on gloo and NCCL)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.stack(parts)


class ContextParallelSparseMLA(torch.autograd.Function):
    """``out, lse`` of sparse MLA over a KV sharded by token range (see the module docstring).
    Differentiable in ``q`` (replicated: the returned gradient is summed over ranks), ``kv_local``
    (this rank's rows) and ``attn_sink``; ``lse`` is returned for inspection, not differentiated."""

    @staticmethod
    def forward(ctx, q, kv_local, local_idx, sm_scale, attn_sink):
        out_r, _, lse_r = mk.sparse_mla_fwd(q, kv_local, local_idx, sm_scale)  # partial: no sink
        out, lse = mk.merge_attn_partials(all_gather_stack(out_r), all_gather_stack(lse_r), attn_sink)
        ctx.save_for_backward(q, kv_local, local_idx, out, lse, attn_sink)
        ctx.sm_scale = sm_scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, kv_local, local_idx, out, lse, attn_sink = ctx.saved_tensors
        dq, dkv, dsink = mk.sparse_mla_bwd(q, kv_local, out, dout.contiguous(), local_idx, lse, ctx.sm_scale,
                                           attn_sink=attn_sink)
        dist.all_reduce(dq)  # each rank's share of dq; dkv stays local; d_attn_sink is the same everywhere
        return dq, dkv, None, None, dsink


def shard_range(n: int, rank: int, world: int):
    per = -(-n // world)
    return min(rank * per, n), min((rank + 1) * per, n)


def local_indices(idx: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return torch.where((idx >= lo) & (idx < hi), idx - lo, torch.full_like(idx, -1))


def rel(a, b):
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    if not torch.equal(fin, torch.isfinite(a)) or not torch.equal(a[~fin], b[~fin]):
        return math.inf
    return ((a[fin] - b[fin]).norm() / b[fin].norm().clamp_min(1e-30)).item()


class Checker:
    def __init__(self, rank):
        self.rank = rank
        self.failed = 0

    def __call__(self, name, err, tol):
        ok = err <= tol
        self.failed += 0 if ok else 1
        print(f"[rank {self.rank}] {'PASS' if ok else 'FAIL'} {name}: rel err {err:.3e} (tol {tol:.0e})", flush=True)


def training_step(args, device, dtype, check):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(args.seed)  # the same problem on every rank
    s_q, h_q, d_qk, d_v, s_kv, topk = args.s_q, args.h_q, args.d_qk, args.d_v, args.s_kv, args.topk
    q_full = (torch.randn(s_q, h_q, d_qk, generator=g) * 0.3).to(device, dtype)
    kv_full = (torch.randn(s_kv, 1, d_qk, generator=g) * 0.3).to(device, dtype)
    idx = torch.rand(s_q, s_kv, generator=g).topk(topk, dim=1).indices.to(torch.int32)
    idx[0] = -1  # an empty row
    idx = idx.to(device)
    sink = torch.randn(h_q, generator=g).to(device)
    w = (torch.randn(s_q, h_q, d_v, generator=g) * 0.1).to(device, dtype)  # loss = sum(out * w)
    sm_scale = d_qk ** -0.5

    # context parallel: this rank's KV rows, local indices
    lo, hi = shard_range(s_kv, rank, world)
    q = q_full.clone().requires_grad_(True)
    kv_local = kv_full[lo:hi].clone().requires_grad_(True)
    sink_p = sink.clone().requires_grad_(True)
    out, lse = ContextParallelSparseMLA.apply(q, kv_local, local_indices(idx, lo, hi).contiguous(), sm_scale, sink_p)
    (out.float() * w.float()).sum().backward()

    # single process: the whole KV
    q1 = q_full.clone().requires_grad_(True)
    kv1 = kv_full.clone().requires_grad_(True)
    sink1 = sink.clone().requires_grad_(True)
    out1, lse1 = mk.sparse_mla(q1, kv1, idx, sm_scale, d_v, None, sink1, return_lse=True)
    (out1.float() * w.float()).sum().backward()

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    check("train forward out", rel(out, out1), tol)
    check("train forward lse", rel(lse, lse1), 1e-5)
    check("train dq (all-reduced)", rel(q.grad, q1.grad), tol)
    check(f"train dkv (local rows {lo}..{hi})", rel(kv_local.grad, kv1.grad[lo:hi]), tol)
    check("train d_attn_sink", rel(sink_p.grad, sink1.grad), max(tol, 1e-4))


def decode_step(args, device, dtype, check):
    """A decode step on a paged cache whose pages are sharded by token range: rank ``r`` holds
    positions ``[lo, hi)`` of every sequence in its own pages with its own block table."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(args.seed + 1)
    b, s_q, h_q, d_qk, topk, seq_len, page = args.b, 2, args.decode_h_q, args.d_qk, args.topk, args.seq_len, 16
    pps = seq_len // page
    kv_seq = (torch.randn(b, seq_len, d_qk, generator=g) * 0.3).to(dtype)  # every sequence's tokens
    q = (torch.randn(b, s_q, h_q, d_qk, generator=g) * 0.3).to(device, dtype)
    pos = torch.rand(b * s_q, seq_len, generator=g).topk(topk, dim=1).indices.reshape(b, s_q, topk).to(torch.int32)
    pos[0, 0, ::3] = -1
    tl = torch.tensor([topk] + [topk // 2] * (b - 1), dtype=torch.int32)
    sink = torch.randn(h_q, generator=g).to(device)
    sm_scale = d_qk ** -0.5

    def paged(tok_lo, tok_hi):
        """A cache of positions [tok_lo, tok_hi) of every sequence (shuffled pages) + block table."""
        n_pg = (tok_hi - tok_lo) // page
        perm = torch.randperm(b * n_pg, generator=torch.Generator().manual_seed(rank + 7))
        cache = torch.empty(b * n_pg, page, 1, d_qk, dtype=dtype)
        cache[perm] = kv_seq[:, tok_lo:tok_hi].reshape(b * n_pg, page, 1, d_qk)
        return cache.to(device), perm.reshape(b, n_pg).to(torch.int32).to(device)

    # context parallel: this rank's token range, local positions
    lo_pg, hi_pg = shard_range(pps, rank, world)
    lo, hi = lo_pg * page, hi_pg * page
    cache_r, bt_r = paged(lo, hi)
    pos_d, tl_d = pos.to(device), tl.to(device)
    plan = mk.decode_plan(b, s_q, h_q, topk, d_qk=d_qk, d_v=args.d_v, device=device, dtype=dtype)
    out_r, lse_r = mk.sparse_mla_decode(q, cache_r, local_indices(pos_d, lo, hi), sm_scale, args.d_v, tl_d,
                                        block_table=bt_r, plan=plan)
    out, lse = mk.merge_attn_partials(all_gather_stack(out_r), all_gather_stack(lse_r), sink)

    # single process: the whole cache
    cache1, bt1 = paged(0, seq_len)
    out1, lse1 = mk.sparse_mla_decode(q, cache1, pos_d, sm_scale, args.d_v, tl_d, sink, block_table=bt1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    check("decode out", rel(out, out1), tol)
    check("decode lse", rel(lse, lse1), 1e-5)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="gloo + the CPU reference (float32)")
    ap.add_argument("--small", action="store_true", help="a small problem (the CI test)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    use_cuda = torch.cuda.is_available() and not args.cpu
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device, dtype, backend = torch.device("cuda", local), torch.bfloat16, "nccl"
    else:
        device, dtype, backend = torch.device("cpu"), torch.float32, "gloo"
    dist.init_process_group(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.small or not use_cuda:
        args.s_q, args.h_q, args.decode_h_q, args.s_kv, args.topk, args.b, args.seq_len = 24, 16, 16, 1000, 128, 3, 512
    else:  # V3.2-like per-rank shapes
        args.s_q, args.h_q, args.decode_h_q, args.s_kv, args.topk, args.b, args.seq_len = 512, 64, 128, 32768, 2048, 4, 8192
    args.d_qk, args.d_v = 576, 512
    if rank == 0:
        print(f"context parallel over {world} ranks ({backend}, {device.type}, {dtype}); backend for the kernels: "
              f"{mk.backend_for(device)}", flush=True)
    check = Checker(rank)
    training_step(args, device, dtype, check)
    decode_step(args, device, dtype, check)
    failed = torch.tensor([check.failed], device=device)
    dist.all_reduce(failed)
    if rank == 0:
        print("PASS: context parallel matches the single-process result" if failed.item() == 0
              else f"FAIL: {int(failed.item())} check(s) failed", flush=True)
    dist.destroy_process_group()
    return 0 if failed.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
