#!/usr/bin/env python3
"""Interleaved A/B timing of several copies of the package in one process (GPU only).

  python tools/ab_bench.py --variant new=. --variant base=/path/to/old/checkout \
      [--ops fwd,bwd] [--shapes v32-h128-kv32k,...] [--rounds 60]

Each ``NAME=DIR[@K=V;K=V]`` names a directory holding a ``mla_kernels`` package (a checkout or an
exported tree) and optional environment knobs set around that variant's calls (knobs the package
reads per call, e.g. ``.@MLA_KERNELS_ATTN_DIST_CTAS=auto``).  Every directory is imported once, under
its own module name, so the compiled kernels of all variants live side by side; then, round after
round, each variant runs one call of the public API on the same rotated
input sets (the order rotates every round), timed with CUDA events.  Interleaving cancels the
clock and power drift that makes two back-to-back ``tools/bench.py`` runs differ by up to ~10% on
an H200 (the first variant's rounds do not run on a cooler GPU than the last's).  Prints the
median ms and TFLOPS per variant and the median of the per-round time ratios against the first
variant -- the number to quote for "within noise".  Shapes and FLOPs are tools/bench.py's.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench  # noqa: E402  (shapes, FLOPs, input sets)

#: tools/bench.py's ops plus ``bwd_asum``: the backward with ``return_attn_sum=True`` (bwd's FLOPs)
AB_OPS = bench.OPS + ("bwd_asum",)


class CudnnPeer:
    """``NAME=@cudnn``: cuDNN-frontend's sm90 DSA kernels (``cudnn.deepseek_sparse_attention``, when
    importable) behind the two calls they have: the backward and the score recompute (attn_dist)."""

    def __init__(self):
        from cudnn import deepseek_sparse_attention as dsa

        self.dsa = dsa

    def sparse_mla_bwd(self, q, kv, out, dout, idx, lse, sm_scale, d_v, deterministic=False):
        import torch

        sink = torch.full((q.shape[1],), -math.inf, device=q.device)
        return self.dsa.sparse_attention_backward_wrapper(
            q, kv.reshape(kv.shape[0], -1), out, dout, lse, sink, idx.reshape(idx.shape[0], -1),
            softmax_scale=sm_scale)

    def attn_dist(self, q, kv, idx, lse, sm_scale):
        return self.dsa.sparse_attn_score_recompute_wrapper(
            q.unsqueeze(0), kv.reshape(kv.shape[0], -1).unsqueeze(0), lse.unsqueeze(0),
            idx.reshape(idx.shape[0], -1).unsqueeze(0), sm_scale, qhead_per_kv_head=q.shape[1],
            topk_length=None, topk_indices_global=False)

    def sparse_mla_fwd(self, *a, **k):
        raise NotImplementedError("cuDNN-frontend has no sm90 sparse forward")


def load_variant(name: str, root: str):
    """Import ``root/mla_kernels`` as module ``mlk_<name>`` (a patched copy in a temp dir);
    ``@cudnn`` gives the cuDNN-frontend peer."""
    if root == "@cudnn":
        return CudnnPeer()
    src = os.path.join(os.path.abspath(root), "mla_kernels")
    if not os.path.isdir(src):
        raise SystemExit(f"ab_bench: {src} is not a directory holding the mla_kernels package")
    mod = f"mlk_{name}"
    tmp = tempfile.mkdtemp(prefix="ab_bench_")
    dst = os.path.join(tmp, mod)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    for dirpath, _, files in os.walk(dst):
        for f in files:
            if f.endswith(".py"):
                p = os.path.join(dirpath, f)
                text = open(p).read()
                if '"mla_kernels.' in text:
                    open(p, "w").write(text.replace('"mla_kernels.', f'"{mod}.'))
    sys.path.insert(0, tmp)
    return importlib.import_module(mod)


def parse_variant(spec: str):
    """``NAME=DIR[@K=V;K=V]`` -> ``(name, dir, {K: V})``."""
    name, _, rest = spec.partition("=")
    if rest == "@cudnn":  # the cuDNN-frontend peer
        return name, rest, {}
    root, _, opts = rest.partition("@")
    env = {}
    for kv in filter(None, opts.split(";")):
        k, _, v = kv.partition("=")
        if not k:
            raise SystemExit(f"--variant: empty knob name in {spec!r}")
        env[k] = v
    if not name or not root:
        raise SystemExit(f"--variant wants NAME=DIR[@K=V;...], got {spec!r}")
    return name, root, env


class _Knobs:
    """Set a variant's environment knobs for the duration of a ``with`` block."""

    def __init__(self, env):
        self.env = env

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def shape_by_name(name: str):
    """A tools/bench.py shape ``(name, s_q, h_q, topk, d_qk, d_v, s_kv)`` by name, or the V3.2
    shape (s_q 4096, topk 2048, d_qk 576, d_v 512) at any h_q and s_kv as ``v32-h<H>-kv<N>k``
    (e.g. ``v32-h64-kv128k``); None if neither."""
    for s in bench.HEADLINE:
        if s[0] == name:
            return s
    m = re.fullmatch(r"v32-h(\d+)-kv(\d+)k", name)
    if m:
        return (name, 4096, int(m.group(1)), 2048, 576, 512, int(m.group(2)) * 1024)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True, metavar="NAME=DIR[@K=V;...]",
                    help="a package copy to time, with optional environment knobs (repeat; the first is the "
                         "reference of the ratios)")
    ap.add_argument("--ops", default="fwd,bwd",
                    help="comma-separated subset of fwd,attn_dist,bwd,bwd_det,bwd_asum (the backward "
                         "with return_attn_sum=True)")
    ap.add_argument("--shapes", default="v32-h128-kv32k", help="comma-separated tools/bench.py shape names")
    ap.add_argument("--rounds", type=int, default=60, help="timed rounds (one call per variant each)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed rounds first")
    ap.add_argument("--sets", type=int, default=3, help="input sets rotated between rounds")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("ab_bench: needs a CUDA GPU")
        return 2
    variants, knobs, by_root = [], {}, {}
    for spec in args.variant:
        name, root, env = parse_variant(spec)
        if root not in by_root:  # one import per directory: variants of it differ in knobs only
            by_root[root] = load_variant(name, root)
        variants.append((name, by_root[root]))
        knobs[name] = _Knobs(env)
    shapes = {s[0]: s for s in bench.HEADLINE}
    ops = [o for o in args.ops.split(",") if o]
    for o in ops:
        if o not in AB_OPS:
            ap.error(f"unknown op {o!r}; choose from {', '.join(AB_OPS)}")
    dev = torch.device("cuda")
    print(f"GPU: {torch.cuda.get_device_name(dev)}; variants: {', '.join(n for n, _ in variants)}")
    rows = []
    for sname in args.shapes.split(","):
        shape = shape_by_name(sname)
        if shape is None:
            ap.error(f"unknown shape {sname!r}; choose from {', '.join(shapes)} or v32-h<H>-kv<N>k")
        _, s_q, h_q, topk, d_qk, d_v, s_kv = shape
        sets = bench.make_sets(args.sets, s_q, h_q, topk, d_qk, d_v, s_kv, dev, torch.bfloat16)
        sm_scale = 1.0 / math.sqrt(d_qk)
        mk0 = variants[0][1]
        for op in ops:
            extra = []
            if op != "fwd":
                os.environ["MLA_KERNELS_BACKEND"] = "sm90"
                for s in sets:
                    out, _, lse = mk0.sparse_mla_fwd(s["q"], s["kv"], s["idx"], sm_scale, d_v)
                    extra.append((out, lse, torch.randn_like(out)))
            os.environ["MLA_KERNELS_BACKEND"] = "sm90"

            def call(mk, i):
                s = sets[i]
                if op == "fwd":
                    return mk.sparse_mla_fwd(s["q"], s["kv"], s["idx"], sm_scale, d_v)
                if op == "attn_dist":
                    return mk.attn_dist(s["q"], s["kv"], s["idx"], extra[i][1], sm_scale)
                out, lse, dout = extra[i]
                return mk.sparse_mla_bwd(s["q"], s["kv"], out, dout, s["idx"], lse, sm_scale, d_v,
                                         deterministic=op == "bwd_det", return_attn_sum=op == "bwd_asum")

            times = {n: [] for n, _ in variants}
            ratios = {n: [] for n, _ in variants}
            for r in range(args.warmup + args.rounds):
                order = variants[r % len(variants):] + variants[: r % len(variants)]
                this = {}
                for n, mk in order:
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    with knobs[n]:
                        a.record()
                        call(mk, r % args.sets)
                        b.record()
                    b.synchronize()
                    this[n] = a.elapsed_time(b)
                if r >= args.warmup:
                    for n in this:
                        times[n].append(this[n])
                        ratios[n].append(this[n] / this[variants[0][0]])
            fl = bench.flops("bwd" if op == "bwd_asum" else op, s_q, h_q, topk, d_qk, d_v)
            for n, _ in variants:
                ms = statistics.median(times[n])
                q1, q3 = statistics.quantiles(times[n], n=4)[0], statistics.quantiles(times[n], n=4)[2]
                rows.append(f"{sname:<18} {op:<9} {n:<10} {ms:8.3f} ms  {fl / ms / 1e9:7.1f} TFLOPS  "
                            f"IQR {q1:.3f}-{q3:.3f}  ratio vs {variants[0][0]}: {statistics.median(ratios[n]):.4f}")
                print(rows[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
