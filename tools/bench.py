#!/usr/bin/env python3
"""Microbenchmark of mla_kernels: every op x shape x available backend.

Prints a table (ms, TFLOPS with DESIGN.md's FLOP conventions, speed-up over the reference),
writes JSON (``--json``) and optionally a bar chart (``--plot FILE.png``).

Method: CUDA events around each call of the public API (validation included), median of
``--reps`` (>= 20) runs after ``--warmup`` runs, inputs rotated over ``--sets`` independent input
sets so that L2 does not hold the previous run's data.  On a machine without a GPU it runs
``--quick`` tiny shapes on the CPU reference and says so.

FLOPs (invalid slots counted, as the peers count them):
  fwd        2 * s_q * h_q * topk * (d_qk + d_v)
  attn_dist  2 * s_q * h_q * topk * d_qk
  bwd        2 * s_q * h_q * topk * (3 * d_qk + 2 * d_v)   (bwd_det: the same, deterministic=True)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from contextlib import contextmanager

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import mla_kernels as mk  # noqa: E402
from mla_kernels import dispatch  # noqa: E402
from mla_kernels.common.problem import Problem  # noqa: E402

OPS = ("fwd", "attn_dist", "bwd", "bwd_det")

# (name, s_q, h_q, topk, d_qk, d_v, s_kv)
HEADLINE = [
    ("v32-h128-kv8k", 4096, 128, 2048, 576, 512, 8192),
    ("v32-h128-kv32k", 4096, 128, 2048, 576, 512, 32768),
    ("v32-h128-kv64k", 4096, 128, 2048, 576, 512, 65536),
    ("v32-h128-kv128k", 4096, 128, 2048, 576, 512, 131072),
    ("v32-h64-kv32k", 4096, 64, 2048, 576, 512, 32768),
    ("decode-sq64-h128", 64, 128, 2048, 576, 512, 32768),
    ("decode-sq1x8-h128", 8, 128, 2048, 576, 512, 32768),
]
QUICK = [
    ("quick-a", 8, 16, 64, 64, 32, 256),
    ("quick-b", 16, 32, 128, 96, 64, 1000),
]


def flops(op, s_q, h_q, topk, d_qk, d_v):
    if op == "fwd":
        return 2.0 * s_q * h_q * topk * (d_qk + d_v)
    if op == "attn_dist":
        return 2.0 * s_q * h_q * topk * d_qk
    return 2.0 * s_q * h_q * topk * (3 * d_qk + 2 * d_v)


@contextmanager
def forced_backend(name):
    old = os.environ.get(dispatch.ENV_BACKEND)
    os.environ[dispatch.ENV_BACKEND] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(dispatch.ENV_BACKEND, None)
        else:
            os.environ[dispatch.ENV_BACKEND] = old


def make_sets(n_sets, s_q, h_q, topk, d_qk, d_v, s_kv, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    sets = []
    for _ in range(n_sets):
        q = torch.randn(s_q, h_q, d_qk, generator=g).to(device, dtype)
        kv = torch.randn(s_kv, 1, d_qk, generator=g).to(device, dtype)
        # distinct random indices per row (as a top-k selection produces), built in row chunks
        idx = torch.empty(s_q, topk, dtype=torch.int32, device=device)
        step = max(1, (1 << 27) // s_kv)
        for r0 in range(0, s_q, step):
            r1 = min(s_q, r0 + step)
            idx[r0:r1] = torch.rand(r1 - r0, s_kv, device=device).topk(topk, dim=1).indices.to(torch.int32)
        sets.append({"q": q, "kv": kv, "idx": idx.reshape(s_q, 1, topk)})
    return sets


def time_fn(fn, n_sets, warmup, reps, device):
    if device.type == "cuda":
        for i in range(warmup):
            fn(i % n_sets)
        torch.cuda.synchronize()
        times = []
        for i in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(i % n_sets)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        return statistics.median(times), times
    for i in range(warmup):
        fn(i % n_sets)
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i % n_sets)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), times


def backends_for(op, device, shape_problem, with_ref=True):
    """Backends to time for op on this device: the kernel backend (if it serves the op) + reference."""
    names = []
    arch = dispatch.backend_for(device)
    if arch != "reference":
        b = dispatch.get_backend(arch)
        why = b.supports("bwd" if op == "bwd_det" else op, shape_problem)
        if why is None:
            names.append(arch)
        else:
            print(f"  [{op}] {arch} does not serve this shape: {why}")
    if with_ref or not names:
        names.append("reference")
    return names


def run(args):
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    quick = args.quick or device.type == "cpu"
    if device.type == "cpu":
        print("NOTE: no CUDA GPU here -- running --quick shapes on the CPU PyTorch reference only; "
              "kernel numbers need an sm_90/sm_100 GPU (see docs/PERF.md).")
        gpu = "cpu"
    else:
        gpu = torch.cuda.get_device_name(device)
        print(f"GPU: {gpu} (capability {torch.cuda.get_device_capability(device)}); "
              f"backend for this device: {mk.backend_for(device)}")
    shapes = QUICK if quick else HEADLINE
    if args.shapes:
        keep = set(args.shapes.split(","))
        shapes = [s for s in shapes if s[0] in keep]
    ops = args.ops.split(",")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for name, s_q, h_q, topk, d_qk, d_v, s_kv in shapes:
        sets = make_sets(args.sets, s_q, h_q, topk, d_qk, d_v, s_kv, device, dtype)
        sm_scale = 1.0 / math.sqrt(d_qk)
        for op in ops:
            st = sets[0]
            prob = Problem(st["q"], st["kv"].reshape(s_kv, d_qk), st["idx"].reshape(s_q, topk), sm_scale,
                           d_v, None, None, st["kv"].shape)
            extra = [None] * args.sets
            if op in ("attn_dist", "bwd", "bwd_det"):
                with forced_backend("reference"):
                    for i, s in enumerate(sets):
                        out, _, lse = mk.sparse_mla_fwd(s["q"], s["kv"], s["idx"], sm_scale, d_v)
                        extra[i] = (out, lse, torch.randn_like(out))
            ref_ms = None
            for be in backends_for(op, device, prob, with_ref=not args.no_ref):
                def call(i, s_=sets, e_=extra):
                    s = s_[i]
                    if op == "fwd":
                        return mk.sparse_mla_fwd(s["q"], s["kv"], s["idx"], sm_scale, d_v)
                    if op == "attn_dist":
                        return mk.attn_dist(s["q"], s["kv"], s["idx"], e_[i][1], sm_scale)
                    out, lse, dout = e_[i]
                    return mk.sparse_mla_bwd(s["q"], s["kv"], out, dout, s["idx"], lse, sm_scale, d_v,
                                             deterministic=op == "bwd_det")

                reps = args.reps if be != "reference" else max(20, args.ref_reps)
                with forced_backend(be):
                    try:
                        med, times = time_fn(call, args.sets, args.warmup, reps, device)
                    except Exception as e:  # report, keep going
                        print(f"  {name} {op} {be}: FAILED {type(e).__name__}: {e}")
                        continue
                tf = flops(op, s_q, h_q, topk, d_qk, d_v) / (med * 1e-3) / 1e12
                if be == "reference":
                    ref_ms = med
                rows.append(dict(shape=name, op=op, backend=be, ms=med, tflops=tf, s_q=s_q, h_q=h_q,
                                 topk=topk, d_qk=d_qk, d_v=d_v, s_kv=s_kv, reps=reps,
                                 min_ms=min(times), max_ms=max(times)))
            for r in rows:
                if r["shape"] == name and r["op"] == op and ref_ms:
                    r["speedup_vs_ref"] = ref_ms / r["ms"]
        del sets
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print()
    hdr = f"{'shape':<20} {'op':<9} {'backend':<10} {'ms':>9} {'TFLOPS':>8} {'x ref':>7}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['shape']:<20} {r['op']:<9} {r['backend']:<10} {r['ms']:>9.3f} {r['tflops']:>8.1f} "
              f"{r.get('speedup_vs_ref', float('nan')):>7.1f}")
    meta = dict(gpu=gpu, torch=torch.__version__, date=time.strftime("%Y-%m-%d"), reps=args.reps,
                warmup=args.warmup, sets=args.sets, quick=quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except Exception as e:
            print(f"--plot skipped: matplotlib unavailable ({e})")
        else:
            labels = [f"{r['shape']}\n{r['op']}/{r['backend']}" for r in rows]
            fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows)), 4))
            ax.bar(range(len(rows)), [r["tflops"] for r in rows])
            ax.set_xticks(range(len(rows)))
            ax.set_xticklabels(labels, rotation=75, fontsize=7)
            ax.set_ylabel("TFLOPS")
            ax.set_title(f"mla_kernels on {gpu}")
            fig.tight_layout()
            fig.savefig(args.plot, dpi=120)
            print(f"wrote {args.plot}")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="fwd,attn_dist,bwd", help="comma-separated: " + ",".join(OPS))
    ap.add_argument("--no-ref", action="store_true", help="do not time the PyTorch reference")
    ap.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (the CPU default)")
    ap.add_argument("--cpu", action="store_true", help="force the CPU even if a GPU is present")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--ref-reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--sets", type=int, default=3, help="independent input sets rotated between runs")
    ap.add_argument("--json", default="")
    ap.add_argument("--plot", default="")
    args = ap.parse_args(argv)
    if args.reps < 20:
        ap.error("--reps must be >= 20 (median of many runs)")
    run(args)


if __name__ == "__main__":
    main()
