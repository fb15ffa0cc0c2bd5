#!/usr/bin/env python3
"""Run every sm90 kernel configuration the dispatch can pick under compute-sanitizer.

  python tools/sanitize.py [--tools memcheck,racecheck,synccheck] [--groups A,B,...] [--log-dir DIR]

Each *group* is one process that runs a small problem (s_q 70, s_kv 1,000, topk 200 -- padded to
256 --, invalid, out-of-range and duplicate indices, an empty row) through the public API with
the sm90 backend forced (``MLA_KERNELS_BACKEND=sm90``: a call the kernels cannot serve raises
instead of falling back): the forward, attention distribution and backward configurations of one
``(d_qk, h_q, options)`` set, the deterministic backward with its segment-sum reduction, and the
backward with an lse gradient (``dlse``).  The tools run in parallel, one process per (group,
tool).  Every op's result is also checked against the CPU float32 reference, so a kernel that
did not run (or ran wrong) under the tool shows up as well.

API-probe noise: under memcheck the DSL's CUDA bindings (cuda-python's ``cydriver``) report
``CUDA_ERROR_INVALID_VALUE`` from ``cuGetProcAddress`` while they look up driver entry points the
installed driver does not export (34 records per process on the H200 host, all before the first
kernel runs).  Those records are counted separately as ``api-probe`` and do not fail the run;
every other API error does.

Output: one line per (kernel configuration, tool) -- the number of error and warning records the
tool printed while that configuration ran (the workload prints BEGIN/END markers around each op
and synchronises, so reports land between them) -- then one line per (group, tool) with the
tool's own summary.  Exit status 1 if any tool reported anything, or any check failed.

Without a GPU (or compute-sanitizer) it says so and exits 2.  ``--workload GROUP`` runs one group
in-process without a sanitizer (what the sanitized processes execute).
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple
from unittest import mock

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

TOOLS = ("memcheck", "racecheck", "synccheck")


@dataclass(frozen=True)
class Group:
    """One process's worth of kernel configurations (all share d_qk and h_q)."""

    name: str
    d_qk: int
    h_q: int
    topk_length: bool
    sink: bool
    normalize: bool  # attn_dist's fused (or host-side) normalisation
    # fwd, fwd_rot (kv-ordered slots: the rotated pair order), attn_dist, attn_dist_persist (a persistent
    # grid of 3 CTAs: many items per CTA; Q through
    # the KV ring, the persistent grid's default in both modes),
    # attn_dist_qscalar (the same with Q by 4-byte loads from global memory), attn_dist_qglobal (the
    # same with Q by 16-byte loads from global memory instead of through the KV ring), bwd,
    # bwd_asum, bwd_det,
    # bwd_det_asum, bwd_dlse
    ops: Tuple[str, ...]


#: Together: both d_qk, h_q 64 / 128 / 192 (attn_dist heads and tokens modes, an odd number of
#: head blocks: no backward cluster pair), topk_length and attn_sink on and off, attn_sum scaled
#: (sink) and unscaled, deterministic with the segment-sum reduction, dlse.
GROUPS = (
    Group("A", 576, 128, True, True, True, ("fwd", "fwd_rot", "attn_dist", "attn_dist_persist", "attn_dist_qscalar",
                                            "attn_dist_qglobal", "bwd",
                                            "bwd_asum", "bwd_det", "bwd_dlse")),
    Group("B", 512, 64, True, False, False, ("fwd", "attn_dist", "attn_dist_persist", "attn_dist_qscalar", "bwd",
                                             "bwd_asum", "bwd_det_asum")),
    Group("C", 576, 192, False, False, True, ("fwd", "attn_dist", "attn_dist_persist", "bwd", "bwd_det", "bwd_dlse")),
    Group("D", 512, 128, False, True, False, ("fwd", "attn_dist", "attn_dist_qglobal", "bwd_asum", "bwd_det")),
    Group("E", 576, 64, False, True, False, ("fwd", "fwd_rot", "attn_dist", "attn_dist_persist", "bwd", "bwd_det_asum")),
    # the decode path (paged cache, block table, q_bias, split-top-k + lse combine, one-split
    # direct bf16 output, heads on the MMA's N side for h_q <= 32, the combine fused into the split
    # kernel: the last CTA merges; the split CTAs of a row as one cluster merging over DSMEM, float32
    # and bf16 staging) and merge_attn_partials
    Group("F", 576, 128, True, True, False, ("decode_split_h128", "decode_direct_h64", "decode_direct_h128_d512",
                                             "decode_direct_h64_oregs", "decode_direct_h64_fixed",
                                             "decode_split_h64_d512_ring", "decode_cluster4_h128_ring",
                                             "decode_split_h128_d512", "decode_narrow_split_h16",
                                             "decode_narrow_direct_h32_d512", "decode_fused_h128",
                                             "decode_narrow_fused_h16", "decode_cluster4_h128",
                                             "decode_cluster2_h64_bf16", "decode_cluster4_h128_l2",
                                             "decode_auto_cluster8_h128", "decode_cluster4_h128_rows32",
                                             "decode_cluster16_h64_rows32", "decode_narrow_cluster16_h16",
                                             "decode_narrow_cluster4_h32_f32", "decode_narrow_cluster16_h8",
                                             "decode_cluster6_h64", "decode_narrow_cluster6_h16",
                                             "decode_direct_h128_pair", "merge")),
)
GROUP_BY_NAME = {g.name: g for g in GROUPS}
#: ``--ops``: the comma-separated ops each group keeps (the sanitized processes read it from here)
ENV_OPS = "MLA_SANITIZE_OPS"


def only_ops(g: Group, ops: str) -> Group:
    """``g`` keeping only the ops named in ``ops`` (comma-separated; empty: all of them)."""
    want = {o for o in ops.split(",") if o}
    return replace(g, ops=tuple(o for o in g.ops if o in want)) if want else g

S_Q, S_KV, TOPK = 70, 1000, 200
MARK = "@@SANITIZE"


def is_decode_op(op: str) -> bool:
    return op.startswith("decode") or op == "merge"


def config_label(g: Group, op: str) -> str:
    if is_decode_op(op):  # the op name carries its own h_q / d_qk (d576 unless named)
        return f"{op:<13} " + " ".join(o for o, on in (("topk_len", g.topk_length), ("sink", g.sink)) if on)
    opts = [f"d{g.d_qk}", f"h{g.h_q}"]
    if g.topk_length:
        opts.append("topk_len")
    if g.sink:
        opts.append("sink")
    if op.startswith("attn_dist") and g.normalize:
        opts.append("norm")
    return f"{op:<13} " + " ".join(opts)


# ---------------------------------------------------------------------------------------------
# The workload (runs under the sanitizer)
# ---------------------------------------------------------------------------------------------


def _case(g: Group, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(S_Q, g.h_q, g.d_qk, generator=gen) * 0.1).to(torch.bfloat16)
    kv = (torch.randn(S_KV, 1, g.d_qk, generator=gen) * 0.1).to(torch.bfloat16)
    idx = torch.randint(0, S_KV, (S_Q, TOPK), generator=gen)
    dup = torch.rand(S_Q, TOPK, generator=gen) < 0.05
    idx = torch.where(dup, idx[:, :1].expand_as(idx), idx)
    bad = torch.rand(S_Q, TOPK, generator=gen) < 0.1
    badval = torch.where(torch.rand(S_Q, TOPK, generator=gen) < 0.5, torch.full_like(idx, -1), idx + S_KV)
    idx = torch.where(bad, badval, idx).to(torch.int32)
    idx[3] = -1  # an empty row
    tl = None
    if g.topk_length:
        tl = torch.randint(0, TOPK + 1, (S_Q,), generator=gen).to(torch.int32)
        tl[0], tl[1] = 0, TOPK
    sink = torch.randn(g.h_q, generator=gen) if g.sink else None
    return q, kv, idx.reshape(S_Q, 1, TOPK), tl, sink


def _rel(a, b) -> float:
    """Relative L2 error of ``a`` against ``b``; non-finite reference entries must match exactly;
    NaN anywhere in ``a`` fails."""
    import torch

    a, b = a.double().cpu(), b.double().cpu()
    if bool(torch.isnan(a).any()):
        return math.inf
    fin = torch.isfinite(b)
    if not bool(fin.all()):
        if not bool((a[~fin] == b[~fin]).all()):
            return math.inf
        a, b = a[fin], b[fin]
    return float((a - b).norm()) / max(float(b.norm()), 1e-30)


def run_workload(g: Group, device: str = "cuda", backend: str = "sm90") -> int:
    """Run the group's ops on ``device`` with ``backend`` forced (sm90 on the GPU; the CPU tests
    use the reference), each between BEGIN/END markers; check each against the CPU float32
    reference.  Returns the number of failed checks."""
    import torch

    import mla_kernels as mk
    from mla_kernels import reference as ref

    os.environ["MLA_KERNELS_BACKEND"] = backend
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    failures = 0

    def step(op: str, fn, checks):
        nonlocal failures
        label = config_label(g, op)
        print(f"{MARK} BEGIN {label}", flush=True)
        err = None
        try:
            res = fn()
            sync()
        except Exception as e:  # a kernel that cannot run is a failure, not a skip
            err = f"{type(e).__name__}: {e}"
            res = None
        if err is None:
            for name, got, want, tol in checks(res):
                r = _rel(got, want)
                if not (r <= tol):
                    err = f"{name} rel err {r:.3g} > {tol}"
                    break
        if err is not None:
            failures += 1
        print(f"{MARK} END {label} | check: {'ok' if err is None else 'FAILED ' + err}", flush=True)
        return res

    if all(is_decode_op(op) for op in g.ops):
        _decode_steps(g, step, dev)
        return failures

    q, kv, idx, tl, sink = _case(g, seed=1234 + g.d_qk + g.h_q)
    sm_scale = g.d_qk ** -0.5
    qd, kvd, idxd = q.to(dev), kv.to(dev), idx.to(dev)
    tld = tl.to(dev) if tl is not None else None
    sinkd = sink.to(dev) if sink is not None else None
    want_out, _, want_lse = ref.sparse_mla_fwd_ref(q.float(), kv.float(), idx, sm_scale, 512, tl, sink)
    dout = (torch.randn(S_Q, g.h_q, 512, generator=torch.Generator().manual_seed(7)) * 0.1).to(torch.bfloat16)

    fwd = None
    if "fwd" in g.ops:  # (with --ops leaving it out, the later ops take the reference's out / lse)
        fwd = step("fwd", lambda: mk.sparse_mla_fwd(qd, kvd, idxd, sm_scale, 512, tld, sinkd),
                   lambda r: [("out", r[0].float(), want_out, 1e-2), ("lse", r[2], want_lse, 1e-5)])
    if "fwd_rot" in g.ops:  # kv-ordered slots: the forward's rotated pair order (its default there)
        with mock.patch.dict(os.environ, {"MLA_KERNELS_FWD_ORDER": "1", "MLA_KERNELS_FWD_ROTATE": "1"}):
            step("fwd_rot", lambda: mk.sparse_mla_fwd(qd, kvd, idxd, sm_scale, 512, tld, sinkd),
                 lambda r: [("out", r[0].float(), want_out, 1e-2), ("lse", r[2], want_lse, 1e-5)])
    out_d, lse_d = (fwd[0], fwd[2]) if fwd is not None else (want_out.to(dev, torch.bfloat16), want_lse.to(dev))
    out_c = out_d.float().cpu()

    if "attn_dist" in g.ops:
        want_asum = ref.attn_dist_ref(q.float(), kv.float(), idx, want_lse, sm_scale, tl, g.normalize)
        step("attn_dist", lambda: mk.attn_dist(qd, kvd, idxd, lse_d, sm_scale, tld, g.normalize),
             lambda r: [("attn_sum", r, want_asum, 1e-3)])
    for op, knobs in (("attn_dist_persist", {"MLA_KERNELS_ATTN_DIST_CTAS": "3"}),
                      ("attn_dist_qscalar", {"MLA_KERNELS_ATTN_DIST_CTAS": "3", "MLA_KERNELS_ATTN_DIST_QVEC": "0",
                                             "MLA_KERNELS_ATTN_DIST_QRING": "0"}),
                      ("attn_dist_qglobal", {"MLA_KERNELS_ATTN_DIST_CTAS": "3", "MLA_KERNELS_ATTN_DIST_QRING": "0"})):
        if op in g.ops:
            with mock.patch.dict(os.environ, knobs):  # restores the caller's values after the step
                step(op, lambda: mk.attn_dist(qd, kvd, idxd, lse_d, sm_scale, tld, g.normalize),
                     lambda r: [("attn_sum", r, want_asum, 1e-3)])

    bwd_ref = {}

    def want_bwd(dlse=None):
        key = dlse is not None
        if key not in bwd_ref:
            bwd_ref[key] = ref.sparse_mla_bwd_ref(
                q.float(), kv.float(), out_c, dout.float(), idx, lse_d.cpu(), sm_scale, 512, tl, sink,
                dlse=dlse, return_attn_sum=True)
        return bwd_ref[key]

    for op in ("bwd", "bwd_asum", "bwd_det", "bwd_det_asum"):
        if op not in g.ops:
            continue
        det, asum = "det" in op, op.endswith("asum")

        def run(det=det, asum=asum):
            return mk.sparse_mla_bwd(qd, kvd, out_d, dout.to(dev), idxd, lse_d, sm_scale, 512, tld, sinkd,
                                     deterministic=det, return_attn_sum=asum)

        def checks(r, asum=asum):
            w = want_bwd()
            c = [("dq", r[0].float(), w[0], 1e-2), ("dkv", r[1].float(), w[1], 1e-2)]
            if sink is not None:
                c.append(("d_sink", r[2], w[2], 1e-2))
            if asum:
                c.append(("attn_sum", r[3], w[3], 1e-3))
            return c

        step(op, run, checks)

    if "bwd_dlse" in g.ops:
        # The autograd op with a loss on lse: the backward gets a dlse (the has_dlse variant).
        dlse = torch.randn(S_Q, g.h_q, generator=torch.Generator().manual_seed(9)) * 0.1

        def run_dlse():
            qg = qd.detach().clone().requires_grad_(True)
            kvg = kvd.detach().clone().requires_grad_(True)
            o, l = mk.sparse_mla(qg, kvg, idxd, sm_scale, 512, tld, sinkd, return_lse=True)
            finite = torch.isfinite(l)
            torch.autograd.backward([o, torch.where(finite, l, 0.0)],
                                    [dout.to(dev), torch.where(finite.cpu(), dlse, 0.0).to(dev)])
            return qg.grad, kvg.grad

        def checks_dlse(r):
            w = ref.sparse_mla_bwd_ref(q.float(), kv.float(), out_c, dout.float(), idx, lse_d.cpu(), sm_scale,
                                       512, tl, sink, dlse=torch.where(torch.isfinite(want_lse), dlse, 0.0))
            return [("dq", r[0].float(), w[0], 1e-2), ("dkv", r[1].float(), w[1], 1e-2)]

        step("bwd_dlse", run_dlse, checks_dlse)
    return failures


def _decode_steps(g: Group, step, dev) -> None:
    """The decode kernels and the lse combine (``sparse_mla_decode`` with explicit plans,
    ``merge_attn_partials``), each checked against the reference."""
    import torch

    import mla_kernels as mk
    from mla_kernels import reference as ref
    from mla_kernels.common.decode_host import ENV_COMBINE

    gen = torch.Generator().manual_seed(4321)
    page, n_pages, b, s_q, topk = 16, 40, 3, 2, 256

    def case(h, d_qk, topk=topk, b=b):
        cache = (torch.randn(n_pages, page, 1, d_qk, generator=gen) * 0.1).to(torch.bfloat16)
        q = (torch.randn(b, s_q, h, d_qk, generator=gen) * 0.1).to(torch.bfloat16)
        bt = torch.randperm(n_pages, generator=gen)[: b * 12].reshape(b, 12).to(torch.int32)
        idx = torch.randint(0, 12 * page, (b, s_q, topk), generator=gen)
        idx = torch.where(torch.rand(b, s_q, topk, generator=gen) < 0.1, torch.full_like(idx, -1), idx).to(torch.int32)
        idx[0, 1] = -1  # an empty row
        tl = torch.randint(1, topk + 1, (b,), generator=gen).to(torch.int32) if g.topk_length else None
        sink = torch.randn(h, generator=gen) if g.sink else None
        bias = (torch.randn(b, h, d_qk, generator=gen) * 0.05).to(torch.bfloat16)
        return cache, q, bt, idx, tl, sink, bias

    def run(op, h, d_qk, splits, combine="separate", env=None, topk=topk, b=b, s_q=s_q):
        cache, q, bt, idx, tl, sink, bias = case(h, d_qk, topk, b)
        scale = d_qk ** -0.5
        w_out, w_lse = ref.sparse_mla_decode_ref(q.float(), cache.float(), idx, scale, 512, tl, sink, bt, bias)
        to = lambda t: t.to(dev) if t is not None else None  # noqa: E731

        def call():
            knobs = {ENV_COMBINE: combine, **(env or {})}  # read when the plan is made
            saved = {k: os.environ.get(k) for k in knobs}
            os.environ.update(knobs)
            try:
                plan = mk.decode_plan(b, s_q, h, topk, d_qk=d_qk, device=dev, num_splits=splits)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k)
                    else:
                        os.environ[k] = v
            return mk.sparse_mla_decode(to(q), to(cache), to(idx), scale, 512, to(tl), to(sink),
                                        block_table=to(bt), q_bias=to(bias), plan=plan)

        step(op, call, lambda r: [("out", r[0].float(), w_out, 1e-2), ("lse", r[1], w_lse, 1e-5)])

    # (direct mode writes O by bulk copies of smem-staged rows -- at d_qk 512 past Q's smem -- unless
    # MLA_KERNELS_DECODE_O=regs)
    for op, h, d_qk, splits, env in (("decode_split_h128", 128, 576, 3, {}), ("decode_direct_h64", 64, 576, 1, {}),
                                     ("decode_narrow_split_h16", 16, 576, 2, {}),
                                     ("decode_narrow_direct_h32_d512", 32, 512, 1, {}),
                                     ("decode_direct_h128_d512", 128, 512, 1, {}),
                                     ("decode_direct_h128_pair", 128, 576, 1, {"MLA_KERNELS_DECODE_PAIR": "1"}),
                                     ("decode_direct_h64_oregs", 64, 576, 1, {"MLA_KERNELS_DECODE_O": "regs"}),
                                     ("decode_split_h128_d512", 128, 512, 3, {}),
                                     # the KV ring off its mode's default (MLA_KERNELS_DECODE_RING: alt
                                     # in direct mode, fixed in split mode by default)
                                     ("decode_direct_h64_fixed", 64, 576, 1, {"MLA_KERNELS_DECODE_RING": "fixed"}),
                                     ("decode_split_h64_d512_ring", 64, 512, 3, {"MLA_KERNELS_DECODE_RING": "alt"})):
        if op in g.ops:
            run(op, h, d_qk, splits, "separate", env)
    for op, h, splits in (("decode_fused_h128", 128, 3), ("decode_narrow_fused_h16", 16, 4)):
        if op in g.ops:
            run(op, h, 576, splits, "fused")
    for op, h, splits, env in (("decode_cluster4_h128", 128, 4, {}),
                               ("decode_cluster4_h128_ring", 128, 4, {"MLA_KERNELS_DECODE_RING": "alt"}),
                               ("decode_cluster2_h64_bf16", 64, 2, {"MLA_KERNELS_DECODE_CLUSTER_PARTS": "bf16"}),
                               ("decode_cluster4_h128_l2", 128, 4, {"MLA_KERNELS_DECODE_CLUSTER_PARTS": "l2"})):
        if op in g.ops:
            run(op, h, 576, splits, "cluster", env)
    rows32 = {"MLA_KERNELS_DECODE_CLUSTER_PARTS": "bf16", "MLA_KERNELS_DECODE_CLUSTER_ROWS": "32"}
    if "decode_cluster4_h128_rows32" in g.ops:  # CTAs of 32 heads (zero padding rows), 24 clusters of 4
        run("decode_cluster4_h128_rows32", 128, 576, 4, "cluster", rows32)
    if "decode_cluster16_h64_rows32" in g.ops:  # b 1's shape: clusters of 16, 2 blocks per CTA
        run("decode_cluster16_h64_rows32", 64, 576, 16, "cluster", rows32, topk=2048, b=1)
    if "decode_narrow_cluster16_h16" in g.ops:  # the narrow kernel's b 1 shape: one cluster of 16, bf16 staging
        run("decode_narrow_cluster16_h16", 16, 576, 16, "cluster", {"MLA_KERNELS_DECODE_CLUSTER_PARTS": "bf16"},
            topk=2048, b=1)
    if "decode_cluster6_h64" in g.ops:  # 6 forced splits in a cluster of 6: 64 heads merged 11 / 9 per CTA
        run("decode_cluster6_h64", 64, 576, 6, "auto", {"MLA_KERNELS_DECODE_CLUSTER_PARTS": "bf16"}, topk=2048, b=2)
    if "decode_narrow_cluster6_h16" in g.ops:  # 6 forced splits: 16 heads merged 3 / 1 per CTA
        run("decode_narrow_cluster6_h16", 16, 576, 6, "auto", {"MLA_KERNELS_DECODE_CLUSTER_PARTS": "bf16"},
            topk=2048, b=2)
    if "decode_narrow_cluster16_h8" in g.ops:  # b 1 at h_q 8: 16 CTAs, each merges half of a head's columns
        run("decode_narrow_cluster16_h8", 8, 576, 16, "cluster", {"MLA_KERNELS_DECODE_CLUSTER_PARTS": "bf16"},
            topk=2048, b=1)
    if "decode_narrow_cluster4_h32_f32" in g.ops:  # 6 clusters of 4, float32 staging, 8 heads merged per CTA
        run("decode_narrow_cluster4_h32_f32", 32, 576, 4, "cluster", {"MLA_KERNELS_DECODE_CLUSTER_PARTS": "f32"})
    if "decode_auto_cluster8_h128" in g.ops:
        # the default rule at b 2, s_q 2 (the first 2 requests): 8 rows of 64 heads, 16-CTA
        # clusters do not all fit on an H100 / H200, so 8 splits in clusters of 8 (bf16 staging)
        run("decode_auto_cluster8_h128", 128, 576, None, "auto", topk=1024, b=2)
    if "merge" in g.ops:
        n, rows, h = 3, 37, 128
        outs = torch.randn(n, rows, h, 512, generator=gen)
        lses = torch.randn(n, rows, h, generator=gen) * 3
        lses[1, :5] = float("inf")  # empty parts
        lses[:, 7] = float("inf")  # an all-empty row
        sink = torch.randn(h, generator=gen) if g.sink else None
        w_out, w_lse = ref.merge_attn_partials_ref(outs, lses, sink, torch.bfloat16)
        step("merge", lambda: mk.merge_attn_partials(outs.to(dev), lses.to(dev),
                                                     sink.to(dev) if sink is not None else None,
                                                     out_dtype=torch.bfloat16),
             lambda r: [("out", r[0].float(), w_out.float(), 1e-2), ("lse", r[1], w_lse, 1e-5)])


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------

_HEADER = re.compile(r"^========= (\S.*)$")
_NOT_RECORD = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY", "Target application")


@dataclass
class Tally:
    errors: int = 0
    warnings: int = 0
    api_probe: int = 0  # cuGetProcAddress lookups of entry points the driver lacks (not a kernel error)
    first: List[str] = field(default_factory=list)
    check: str = "not run"


def is_api_probe(record: str) -> bool:
    return "on CUDA API call to cuGetProcAddress" in record


def parse_log(text: str, tool: str, mark: str = MARK) -> Tuple[Dict[str, Tally], Optional[str], List[str], int]:
    """Split a sanitized workload's output by the BEGIN/END markers.

    Returns ``(per-config tallies, the tool's summary line, record headers outside any marker,
    the number of API-probe records anywhere)``.
    A record header is a ``=========`` line whose text starts right after the prefix (details are
    indented); racecheck's ``Warning:`` records and memcheck/synccheck's others are errors.
    """
    per: Dict[str, Tally] = {}
    summary = None
    stray: List[str] = []
    probes = 0
    cur: Optional[str] = None
    for line in text.splitlines():
        if line.startswith(mark):
            rest = line[len(mark):].strip()
            if rest.startswith("BEGIN "):
                cur = rest[6:].strip()
                per.setdefault(cur, Tally())
            elif rest.startswith("END "):
                label, _, check = rest[4:].partition("| check:")
                per.setdefault(label.strip(), Tally()).check = check.strip()
                cur = None
            continue
        m = _HEADER.match(line)
        if not m:
            continue
        body = m.group(1)
        if body.startswith(("ERROR SUMMARY", "RACECHECK SUMMARY")):
            summary = body
            continue
        if body.startswith(_NOT_RECORD):
            continue
        if is_api_probe(body):
            probes += 1
            if cur is not None:
                per[cur].api_probe += 1
            continue
        is_warning = body.startswith("Warning")
        if cur is None:
            stray.append(body)
            continue
        t = per[cur]
        if is_warning:
            t.warnings += 1
        else:
            t.errors += 1
        if len(t.first) < 2:
            t.first.append(body[:160])
    return per, summary, stray, probes


def summary_clean(summary: Optional[str], api_probes: int = 0) -> bool:
    """``ERROR SUMMARY: 0 errors`` (or as many errors as API-probe records) /
    ``RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)``."""
    if summary is None:
        return False
    m = re.search(r"ERROR SUMMARY: (\d+) error", summary)
    if m:
        return int(m.group(1)) == api_probes
    return bool(re.search(r"SUMMARY: 0 hazards", summary))


def find_sanitizer() -> Optional[str]:
    exe = shutil.which("compute-sanitizer")
    if exe:
        return exe
    hits = sorted(glob.glob("/usr/local/cuda*/bin/compute-sanitizer")) + sorted(
        glob.glob("/usr/local/cuda*/compute-sanitizer/compute-sanitizer"))
    return hits[-1] if hits else None


def tool_args(tool: str) -> List[str]:
    args = ["--tool", tool, "--print-limit", "100000", "--error-exitcode", "1"]
    if tool == "racecheck":
        args += ["--racecheck-report", "all"]
    return args


def run_one(san: str, g: Group, tool: str, log_dir: str, timeout: float):
    cmd = [san] + tool_args(tool) + [sys.executable, os.path.abspath(__file__), "--workload", g.name]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        text += f"\n(timed out after {timeout:.0f} s)"
        rc = -1
    secs = time.time() - t0
    with open(os.path.join(log_dir, f"{g.name}_{tool}.log"), "w") as f:
        f.write(" ".join(cmd) + "\n" + text)
    return g, tool, text, rc, secs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tools", default=",".join(TOOLS),
                    help=f"comma-separated subset of {','.join(TOOLS)} (default: all)")
    ap.add_argument("--groups", default=",".join(GROUP_BY_NAME),
                    help=f"comma-separated subset of the configuration groups {','.join(GROUP_BY_NAME)} "
                         "(default: all; `--list` shows them)")
    ap.add_argument("--log-dir", default="sanitize-logs", help="where each (group, tool) log is written")
    ap.add_argument("--jobs", type=int, default=6, help="sanitized processes run at once (default 6)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per sanitized process (default 900)")
    ap.add_argument("--ops", default="",
                    help="comma-separated op names to keep in each group (default: all; e.g. "
                         "attn_dist,attn_dist_persist -- a group left with none is skipped)")
    ap.add_argument("--list", action="store_true", help="print the configurations and exit")
    ap.add_argument("--workload", metavar="GROUP", choices=sorted(GROUP_BY_NAME),
                    help="run one group in-process (what the sanitized processes execute)")
    args = ap.parse_args(argv)

    if args.workload:
        return 1 if run_workload(only_ops(GROUP_BY_NAME[args.workload], os.environ.get(ENV_OPS, ""))) else 0

    tools = [t for t in args.tools.split(",") if t]
    groups = [x for x in args.groups.split(",") if x]
    for t in tools:
        if t not in TOOLS:
            ap.error(f"unknown tool {t!r}; choose from {', '.join(TOOLS)}")
    for x in groups:
        if x not in GROUP_BY_NAME:
            ap.error(f"unknown group {x!r}; choose from {', '.join(GROUP_BY_NAME)}")
    if args.ops:
        os.environ[ENV_OPS] = args.ops  # the sanitized processes (run_one passes the environment on)
    picked = [g for g in (only_ops(GROUP_BY_NAME[x], args.ops) for x in groups) if g.ops]
    if not picked:
        ap.error(f"--ops {args.ops!r} leaves no op in the chosen groups")
    if args.list:
        for g in picked:
            for op in g.ops:
                print(f"{g.name}  {config_label(g, op)}")
        return 0

    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("sanitize: needs an sm_90 GPU (the sm90 kernels are what it checks); none here")
        return 2
    san = find_sanitizer()
    if san is None:
        print("sanitize: compute-sanitizer not found (PATH, /usr/local/cuda*/bin)")
        return 2
    os.makedirs(args.log_dir, exist_ok=True)
    print(f"sanitize: {san} on {torch.cuda.get_device_name()}; {len(picked)} groups x {len(tools)} tools; "
          f"logs in {args.log_dir}/", flush=True)

    jobs = [(g, t) for g in picked for t in tools]
    bad = 0
    rows = []
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futs = [pool.submit(run_one, san, g, t, args.log_dir, args.timeout) for g, t in jobs]
        for fut in futs:
            g, tool, text, rc, secs = fut.result()
            per, summary, stray, probes = parse_log(text, tool)
            for op in g.ops:
                label = config_label(g, op)
                t = per.get(label, Tally())
                ok = t.errors == 0 and t.warnings == 0 and t.check == "ok"
                bad += not ok
                first = ("  first: " + t.first[0]) if t.first else ""
                probe = f" ({t.api_probe} api-probe)" if t.api_probe else ""
                rows.append(f"{g.name}  {label:<40} {tool:<9} {t.errors:>6} errors {t.warnings:>6} warnings{probe}  "
                            f"check {t.check}{first}")
            clean = summary_clean(summary, probes) and (rc == 0 or probes > 0) and not stray
            bad += not clean
            rows.append(f"{g.name}  {'(whole process)':<40} {tool:<9} rc={rc} {secs:.0f}s  "
                        f"{summary or 'no summary (crashed or timed out?)'}"
                        + (f"  outside markers: {stray[0][:120]}" if stray else ""))
            print(rows[-1], flush=True)
    print()
    for r in rows:
        print(r)
    print(f"\nsanitize: {'CLEAN' if bad == 0 else f'{bad} problem line(s)'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
