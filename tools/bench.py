#!/usr/bin/env python3
"""Benchmark of mla_kernels next to the implementations a user could run instead.

For every op x shape it times each implementation present on this machine, in one run, on the
same inputs, and prints one table per op: one row per shape, one column per implementation
(milliseconds and TFLOP/s).  Implementations:

  ours          mla_kernels' kernel backend for this GPU (sm90 / sm100)
  reference     mla_kernels' plain-PyTorch reference (float32 math; --no-ref skips it)
  cudnn         cuDNN-frontend's DSA kernels, if `cudnn.deepseek_sparse_attention` imports:
                backward (bwd) and score recompute (attn_dist)
  flashmla      FlashMLA's sparse prefill forward, if the `flash_mla` module imports (fwd)
  flashmla-bin  FlashMLA's standalone sm90 prefill benchmark binary (fwd), if found under
                --peers DIR/anchors/flashmla/ (it generates its own inputs of the same shape and
                times itself: median of BENCH_ITERS launches, set to --reps)

Method: CUDA events around one call of each implementation's public entry point (validation
included), median of --reps (>= 20) runs after --warmup runs; --sets independent input sets
rotated between runs so L2 does not hold the previous run's KV; distinct random indices per row
(as a top-k selection produces).  A progress line is printed as each measurement finishes.
With --b2b N each sample is instead N calls back to back between one event pair (no synchronize
between them; the sets still rotate), divided by N: how the FlashMLA binary times itself, so the
method to use when comparing with it (measured with tools/fwd_method_check.py on an H200: the
per-call method reads ours 2-5% slower than back to back).  (First GPU run: docs/PERF.md, commit dc71048.)

FLOPs (invalid slots counted, as the peers count them; docs/METHOD.md):
  fwd        2 * s_q * h_q * topk * (d_qk + d_v)
  attn_dist  2 * s_q * h_q * topk * d_qk
  bwd        2 * s_q * h_q * topk * (3 * d_qk + 2 * d_v)   (bwd_det: the same, deterministic=True)

Without a GPU (or with --cpu) it times the PyTorch reference on the CPU on tiny --quick shapes:
a smoke test of this tool and of the reference, reported in GFLOP/s; it says nothing about the
kernels, whose numbers need an sm_90 / sm_100 GPU (docs/PERF.md).

--plot FILE draws the tables as a grouped bar chart (one panel per op, shapes on the x axis, one
bar per implementation; needs matplotlib: pip install -e ".[test]").  --json FILE writes every
measurement with the run's metadata.

More ops from other files: a module tools/bench_<family>.py next to this one (bench_decode.py,
bench_indexer.py, ...) is picked up when present, and `--ops <family>` runs it.  It defines

    def bench_rows(ctx) -> list[dict]          # required
    SHAPES = ("name", ...)                      # optional: shape names --shapes accepts
    DESCRIPTION = "one line"                    # optional: shown in --help

`ctx` is a BenchContext: ctx.device, ctx.dtype, ctx.quick, ctx.reps, ctx.warmup, ctx.sets,
ctx.no_ref, ctx.peers (a Path or None), ctx.wants(shape_name) (the --shapes filter),
ctx.time(fn) -> (median_ms, all_ms) (fn(i) runs input set i % ctx.sets: this tool's method),
ctx.progress(text) and ctx.random_indices(s_q, s_kv, topk).  Each returned row is a dict with

    op (str), shape (str), impl (str: "ours", "reference", "cudnn", "flashmla", ...),
    ms (float), flops (float or None: the TFLOP/s column is left empty)

plus any other JSON-serialisable keys (kept in --json).  Rows of a family form their own table(s),
one per op name they carry.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, List, Optional

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import mla_kernels as mk  # noqa: E402
from mla_kernels import dispatch  # noqa: E402
from mla_kernels.common.problem import Problem  # noqa: E402

OPS = ("fwd", "attn_dist", "bwd", "bwd_det")
IMPL_ORDER = ("ours", "flashmla", "flashmla-bin", "cudnn", "reference")

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


# ---------------------------------------------------------------------------------------------
# Method
# ---------------------------------------------------------------------------------------------


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


def random_indices(s_q, s_kv, topk, device):
    """Distinct random indices per row (as a top-k selection produces), built in row chunks;
    -1 beyond s_kv when topk > s_kv."""
    idx = torch.full((s_q, topk), -1, dtype=torch.int32, device=device)
    k = min(topk, s_kv)
    step = max(1, (1 << 27) // max(s_kv, 1))
    for r0 in range(0, s_q, step):
        r1 = min(s_q, r0 + step)
        idx[r0:r1, :k] = torch.rand(r1 - r0, s_kv, device=device).topk(k, dim=1).indices.to(torch.int32)
    return idx


def make_sets(n_sets, s_q, h_q, topk, d_qk, d_v, s_kv, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    sets = []
    for _ in range(n_sets):
        q = torch.randn(s_q, h_q, d_qk, generator=g).to(device, dtype)
        kv = torch.randn(s_kv, 1, d_qk, generator=g).to(device, dtype)
        idx = random_indices(s_q, s_kv, topk, device)
        sets.append({"q": q, "kv": kv, "idx": idx.reshape(s_q, 1, topk)})
    return sets


def time_fn(fn, n_sets, warmup, reps, device, b2b: int = 0, warm_s: float = 0.0):
    """``fn(i)`` runs input set ``i % n_sets``; returns ``(median ms, all ms)``.

    ``b2b`` 0: each sample is one call between two events, synchronized after it (the host time
    of the call shows where the GPU waits for it).  ``b2b`` N > 0: each sample is N calls back to
    back (input sets still rotating) between one event pair, divided by N -- the way FlashMLA's
    anchor binary times itself, so the method to compare with it.  ``warm_s`` > 0: after the
    ``warmup`` calls, keep calling for that many seconds, so that the timed calls start from the
    GPU's sustained clock / power state (``--warm-s``)."""
    n = max(1, b2b)
    if device.type == "cuda":
        for i in range(warmup):
            fn(i % n_sets)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while warm_s > 0 and time.perf_counter() - t0 < warm_s:
            for i in range(4):
                fn(i % n_sets)
            torch.cuda.synchronize()
        times = []
        for i in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for j in range(n):
                fn((i * n + j) % n_sets)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / n)
        return statistics.median(times), times
    for i in range(warmup):
        fn(i % n_sets)
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        for j in range(n):
            fn((i * n + j) % n_sets)
        times.append((time.perf_counter() - t0) * 1e3 / n)
    return statistics.median(times), times


@dataclasses.dataclass
class BenchContext:
    """What a benchmark family (tools/bench_<family>.py) receives; see the module docstring."""

    device: torch.device
    dtype: torch.dtype
    quick: bool
    reps: int
    warmup: int
    sets: int
    no_ref: bool
    peers: Optional[Path]
    shapes: Optional[set]
    progress: Callable[[str], None]
    ref_reps: int = 20
    b2b: int = 0  # calls per timed sample, back to back (0: one call, synchronized; see time_fn)
    warm_s: float = 0.0  # seconds of untimed calls before each measurement (see time_fn)

    def wants(self, shape_name: str) -> bool:
        return not self.shapes or shape_name in self.shapes

    def time(self, fn, reps: Optional[int] = None):
        return time_fn(fn, self.sets, self.warmup, reps or self.reps, self.device, self.b2b, self.warm_s)

    def random_indices(self, s_q, s_kv, topk):
        return random_indices(s_q, s_kv, topk, self.device)


class Progress:
    """One line per finished measurement: count, elapsed time, shape i/n, what was measured."""

    def __init__(self, n_shapes: int = 0):
        self.n_shapes, self.shape_i, self.done, self.t0 = n_shapes, 0, 0, time.time()

    def __call__(self, text: str, count: bool = True) -> None:
        self.done += int(count)
        el = int(time.time() - self.t0)
        where = f" shape {self.shape_i}/{self.n_shapes}" if self.n_shapes else ""
        print(f"[{self.done:3d} {el // 60}:{el % 60:02d}{where}] {text}", flush=True)


# ---------------------------------------------------------------------------------------------
# Peers
# ---------------------------------------------------------------------------------------------


def _cudnn():
    try:
        from cudnn.deepseek_sparse_attention import sparse_attention_backward_wrapper as bwd
    except Exception as e:
        return None, f"cudnn: not importable ({type(e).__name__}: {str(e)[:120]})"
    try:
        from cudnn.deepseek_sparse_attention import sparse_attn_score_recompute_wrapper as sr
    except Exception:
        sr = None
    return {"bwd": bwd, "attn_dist": sr}, None


def _flashmla():
    try:
        import flash_mla

        return flash_mla.flash_mla_sparse_fwd, None
    except Exception as e:
        return None, f"flashmla: python module not importable ({type(e).__name__})"


def find_peers(arg: str) -> Optional[Path]:
    """--peers, else $MLA_KERNELS_PEERS, else a .peers directory next to the repository."""
    for cand in (arg, os.environ.get("MLA_KERNELS_PEERS", ""), str(REPO / ".peers"),
                 str(REPO.parent.parent / ".peers")):
        if cand and Path(cand).is_dir():
            return Path(cand)
    return None


def flashmla_anchor(binary: Path, s_q, s_kv, topk, h_q, reps, warmup, timeout=600, warm_s: float = 0.0,
                    est_ms: Optional[float] = None):
    """Run FlashMLA's standalone prefill benchmark for one case; ``(median_ms, None)`` or
    ``(None, why)``.  Its output line: ``s_q s_kv topk h_q time_ms TFLOPS median_ms``.
    ``warm_s`` with ``est_ms`` (a guess of one launch's time: ours): enough warm-up launches for
    that many seconds, as :func:`time_fn` does for ours."""
    if warm_s > 0 and est_ms:
        warmup = max(warmup, math.ceil(warm_s * 1e3 / est_ms))
    env = dict(os.environ, BENCH_ITERS=str(reps), BENCH_WARMUP=str(warmup))
    try:
        r = subprocess.run([str(binary), f"{s_q}:{s_kv}:{topk}:{h_q}"], capture_output=True, text=True,
                           timeout=timeout, env=env)
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"
    ms = parse_anchor_line(r.stdout, (s_q, s_kv, topk, h_q))
    if ms is None:
        return None, f"no result line (exit {r.returncode}): {(r.stdout + r.stderr).strip()[-200:]}"
    return ms, None


def parse_anchor_line(text: str, case) -> Optional[float]:
    """The median ms of the line whose first fields are ``case`` (ints), or None."""
    for line in text.splitlines():
        f = line.split()
        if len(f) < len(case) + 3:
            continue
        try:
            head = tuple(int(x) for x in f[: len(case)])
            vals = [float(x) for x in f[len(case): len(case) + 3]]
        except ValueError:
            continue
        if head == tuple(case):
            return vals[2]
    return None


# ---------------------------------------------------------------------------------------------
# The built-in ops
# ---------------------------------------------------------------------------------------------


def _ours(op, device, prob):
    """The kernel backend's name if it serves ``op`` here, else None (and why)."""
    try:
        arch = dispatch.backend_for(device)
    except mk.BackendUnavailableError as e:
        return None, str(e)
    if arch == "reference":
        return None, None
    why = dispatch.get_backend(arch).supports("bwd" if op == "bwd_det" else op, prob)
    return (arch, None) if why is None else (None, f"{arch} does not serve this shape: {why}")


def builtin_rows(ctx: BenchContext, ops, shapes, prog: Progress):
    rows = []
    peers_cudnn, why_cudnn = _cudnn() if ctx.device.type == "cuda" else (None, "cudnn: needs a GPU")
    peer_fmla, why_fmla = _flashmla() if ctx.device.type == "cuda" else (None, None)
    anchor = None
    if ctx.device.type == "cuda" and ctx.peers is not None:
        b = ctx.peers / "anchors" / "flashmla" / "bench_sm90"
        anchor = b if b.exists() and os.access(b, os.X_OK) else None
    for why in (why_cudnn, why_fmla):
        if why and ctx.device.type == "cuda":
            print(f"note: {why}")
    for name, s_q, h_q, topk, d_qk, d_v, s_kv in shapes:
        prog.shape_i += 1
        sets = make_sets(ctx.sets, s_q, h_q, topk, d_qk, d_v, s_kv, ctx.device, ctx.dtype)
        sm_scale = 1.0 / math.sqrt(d_qk)
        st = sets[0]
        prob = Problem(st["q"], st["kv"].reshape(s_kv, d_qk), st["idx"].reshape(s_q, topk), sm_scale,
                       d_v, None, None, st["kv"].shape)
        extra = None
        for op in ops:
            fl = flops(op, s_q, h_q, topk, d_qk, d_v)
            if op != "fwd" and extra is None:
                extra = []
                with forced_backend("reference"):
                    for s in sets:
                        out, _, lse = mk.sparse_mla_fwd(s["q"], s["kv"], s["idx"], sm_scale, d_v)
                        extra.append((out, lse, torch.randn_like(out)))
            impls = {}
            arch, why = _ours(op, ctx.device, prob)
            if why:
                print(f"note: {name} {op}: {why}")

            def ours_call(i, op=op):
                s = sets[i]
                if op == "fwd":
                    return mk.sparse_mla_fwd(s["q"], s["kv"], s["idx"], sm_scale, d_v)
                if op == "attn_dist":
                    return mk.attn_dist(s["q"], s["kv"], s["idx"], extra[i][1], sm_scale)
                out, lse, dout = extra[i]
                return mk.sparse_mla_bwd(s["q"], s["kv"], out, dout, s["idx"], lse, sm_scale, d_v,
                                         deterministic=op == "bwd_det")

            if arch:
                impls["ours"] = (arch, ours_call)
            if not ctx.no_ref or not impls:
                impls["reference"] = ("reference", ours_call)
            if op == "fwd" and peer_fmla is not None and d_v == 512:
                impls["flashmla"] = (None, lambda i: peer_fmla(sets[i]["q"], sets[i]["kv"], sets[i]["idx"],
                                                               sm_scale, d_v))
            if op in ("bwd", "attn_dist") and peers_cudnn and peers_cudnn.get(op) is not None and d_v == 512:
                sink = torch.full((h_q,), -math.inf, device=ctx.device, dtype=torch.float32)
                if op == "bwd":
                    f = peers_cudnn["bwd"]
                    impls["cudnn"] = (None, lambda i: f(sets[i]["q"], sets[i]["kv"].reshape(s_kv, d_qk), extra[i][0],
                                                        extra[i][2], extra[i][1], sink,
                                                        sets[i]["idx"].reshape(s_q, topk), softmax_scale=sm_scale))
                else:
                    f = peers_cudnn["attn_dist"]
                    impls["cudnn"] = (None, lambda i: f(sets[i]["q"].unsqueeze(0), sets[i]["kv"].reshape(1, s_kv, d_qk),
                                                        extra[i][1].unsqueeze(0),
                                                        sets[i]["idx"].reshape(1, s_q, topk), sm_scale,
                                                        qhead_per_kv_head=h_q, topk_length=None,
                                                        topk_indices_global=False))
            for impl, (backend, call) in impls.items():
                reps = ctx.reps if impl != "reference" else ctx.ref_reps
                try:
                    with forced_backend(backend or "auto"):
                        med, times = time_fn(call, ctx.sets, ctx.warmup, reps, ctx.device, ctx.b2b,
                                             ctx.warm_s if impl != "reference" else 0.0)
                except Exception as e:  # report, keep going
                    prog(f"{name} {op} {impl}: FAILED {type(e).__name__}: {str(e)[:200]}", count=True)
                    continue
                rows.append(dict(op=op, shape=name, impl=impl, backend=backend, ms=med, flops=fl, reps=reps, b2b=ctx.b2b,
                                 min_ms=min(times), max_ms=max(times), s_q=s_q, h_q=h_q, topk=topk, d_qk=d_qk,
                                 d_v=d_v, s_kv=s_kv))
                prog(f"{name} {op} {impl}: {med:.3f} ms  {_rate(fl, med, ctx.device)}", count=True)
            if op == "fwd" and anchor is not None:
                if d_qk == 576 and d_v == 512 and h_q in (64, 128) and topk % 128 == 0:
                    ours = [r["ms"] for r in rows if r["shape"] == name and r["op"] == "fwd" and r["impl"] == "ours"]
                    ms, why = flashmla_anchor(anchor, s_q, s_kv, topk, h_q, ctx.reps, ctx.warmup, warm_s=ctx.warm_s,
                                              est_ms=ours[0] if ours else None)
                    if ms is None:
                        prog(f"{name} fwd flashmla-bin: FAILED {why}", count=True)
                    else:
                        rows.append(dict(op=op, shape=name, impl="flashmla-bin", backend=None, ms=ms, flops=fl,
                                         reps=ctx.reps, s_q=s_q, h_q=h_q, topk=topk, d_qk=d_qk, d_v=d_v,
                                         s_kv=s_kv, note="the binary's own inputs and timing loop"))
                        prog(f"{name} fwd flashmla-bin: {ms:.3f} ms  {_rate(fl, ms, ctx.device)}", count=True)
        del sets, extra
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# Families (tools/bench_<family>.py)
# ---------------------------------------------------------------------------------------------


def load_families(dirs=None) -> Dict[str, object]:
    fams = {}
    for d in dirs or [TOOLS]:
        for path in sorted(glob.glob(os.path.join(str(d), "bench_*.py"))):
            name = Path(path).stem[len("bench_"):]
            if not name or name in OPS or name in fams:
                continue
            spec = importlib.util.spec_from_file_location(f"mla_bench_{name}", path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            try:
                spec.loader.exec_module(mod)
            except Exception as e:
                print(f"note: tools/bench_{name}.py not loaded ({type(e).__name__}: {e})")
                continue
            if callable(getattr(mod, "bench_rows", None)):
                fams[name] = mod
    return fams


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def _rate(fl, ms, device) -> str:
    if not fl or not ms:
        return ""
    r = fl / (ms * 1e-3)
    return f"{r / 1e12:.1f} TFLOPS" if device.type == "cuda" else f"{r / 1e9:.2f} GFLOP/s"


def _impl_order(impls):
    known = [i for i in IMPL_ORDER if i in impls]
    return known + sorted(i for i in impls if i not in IMPL_ORDER)


def print_tables(rows, device, file=sys.stdout):
    unit, scale = ("TFLOPS", 1e12) if device.type == "cuda" else ("GFLOP/s", 1e9)
    for op in dict.fromkeys(r["op"] for r in rows):
        sub = [r for r in rows if r["op"] == op]
        impls = _impl_order({r["impl"] for r in sub})
        shapes = list(dict.fromkeys(r["shape"] for r in sub))
        cell = {(r["shape"], r["impl"]): r for r in sub}
        w = max(18, *(len(s) for s in shapes))
        print(f"\n{op}: ms / {unit} (median)", file=file)
        head = f"{'shape':<{w}}" + "".join(f" | {i:>22}" for i in impls)
        print(head, file=file)
        print("-" * len(head), file=file)
        for s in shapes:
            line = f"{s:<{w}}"
            for i in impls:
                r = cell.get((s, i))
                if r is None:
                    line += f" | {'--':>22}"
                else:
                    rate = f"{r['flops'] / (r['ms'] * 1e-3) / scale:.{1 if scale == 1e12 else 2}f}" \
                        if r.get("flops") else "--"
                    line += f" | {r['ms']:>10.3f} {rate:>11}"
            print(line, file=file)


def plot(rows, path, title, device):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"--plot skipped: matplotlib unavailable ({e}); pip install matplotlib")
        return False
    unit, scale = ("TFLOP/s", 1e12) if device.type == "cuda" else ("GFLOP/s", 1e9)
    ops = [op for op in dict.fromkeys(r["op"] for r in rows) if any(r.get("flops") for r in rows if r["op"] == op)]
    if not ops:
        print("--plot skipped: no rows with a FLOP count")
        return False
    all_impls = _impl_order({r["impl"] for r in rows})
    colors = {i: plt.cm.tab10(k % 10) for k, i in enumerate(all_impls)}
    fig, axes = plt.subplots(len(ops), 1, figsize=(max(7, 1.6 * max(len({r["shape"] for r in rows if r["op"] == o})
                                                                       for o in ops) + 3), 3.4 * len(ops)),
                             squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        sub = [r for r in rows if r["op"] == op and r.get("flops")]
        shapes = list(dict.fromkeys(r["shape"] for r in sub))
        impls = _impl_order({r["impl"] for r in sub})
        width = 0.8 / max(1, len(impls))
        cell = {(r["shape"], r["impl"]): r for r in sub}
        for k, impl in enumerate(impls):
            xs, ys = [], []
            for j, s in enumerate(shapes):
                r = cell.get((s, impl))
                if r is not None:
                    xs.append(j - 0.4 + width * (k + 0.5))
                    ys.append(r["flops"] / (r["ms"] * 1e-3) / scale)
            bars = ax.bar(xs, ys, width, label=impl, color=colors[impl])
            ax.bar_label(bars, fmt="%.0f" if device.type == "cuda" else "%.2f", fontsize=7, padding=1)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes, fontsize=8)
        ax.set_ylabel(unit)
        ax.set_title(op, fontsize=10, loc="left")
        ax.margins(y=0.15)
        ax.legend(fontsize=8, ncol=len(impls), loc="upper right")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return True


def _commit() -> str:
    """The repository's short commit (``$MLA_KERNELS_COMMIT`` where the checkout has no git)."""
    if os.environ.get("MLA_KERNELS_COMMIT"):
        return os.environ["MLA_KERNELS_COMMIT"]
    try:
        r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=10)
        return r.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _csv_choice(choices, what):
    def parse(text):
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(map(repr, bad)) or repr(text)}; choose from: {', '.join(choices)}")
        return items
    return parse


def build_parser(families):
    fam_help = "".join(f"; {n}: {getattr(m, 'DESCRIPTION', 'rows from tools/bench_' + n + '.py')}"
                       for n, m in families.items())
    op_choices = list(OPS) + list(families)
    shape_choices = [s[0] for s in HEADLINE + QUICK]
    for m in families.values():
        shape_choices += [s for s in getattr(m, "SHAPES", ()) if s not in shape_choices]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=_csv_choice(op_choices, "op"), default=["fwd", "attn_dist", "bwd"],
                    metavar="OP[,OP...]",
                    help=f"comma-separated ops to time (default fwd,attn_dist,bwd); choices: {', '.join(op_choices)}"
                         f"{fam_help}")
    ap.add_argument("--shapes", type=_csv_choice(shape_choices, "shape"), default=None, metavar="NAME[,NAME...]",
                    help=f"comma-separated shape names (default: all of the mode's shapes); choices: "
                         f"{', '.join(shape_choices)}")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (the default without a GPU)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even if a GPU is present")
    ap.add_argument("--no-ref", action="store_true", help="do not time the PyTorch reference (it is ~30x slower)")
    ap.add_argument("--reps", type=int, default=30, help="timed runs per measurement, >= 20 (default 30)")
    ap.add_argument("--ref-reps", type=int, default=20, help="timed runs of the reference, >= 20 (default 20)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed runs before timing (default 5)")
    ap.add_argument("--sets", type=int, default=3, help="independent input sets rotated between runs (default 3)")
    ap.add_argument("--b2b", type=int, default=0, metavar="N",
                    help="time N calls back to back per sample (one event pair, no synchronize between them): "
                         "FlashMLA's binary's method, for comparing with it (default 0: one synchronized call)")
    ap.add_argument("--warm-s", type=float, default=0.0, metavar="S",
                    help="keep calling for S seconds before each measurement (ours, the peers, FlashMLA's binary), "
                         "so that every implementation is timed in the GPU's sustained clock / power state "
                         "(default 0: only --warmup calls)")
    ap.add_argument("--peers", default="", metavar="DIR",
                    help="directory with FlashMLA's anchor binaries under anchors/flashmla/ (default: "
                         "$MLA_KERNELS_PEERS or a .peers directory next to the repository)")
    ap.add_argument("--json", default="", metavar="FILE", help="write every measurement and the run's metadata")
    ap.add_argument("--plot", default="", metavar="FILE", help="draw a grouped bar chart (PNG) of the tables")
    return ap


def run(args, families):
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    quick = args.quick or device.type == "cpu"
    if device.type == "cpu":
        print("NOTE: no CUDA GPU here -- running --quick shapes on the CPU PyTorch reference only: this measures "
              "the reference's CPU speed (GFLOP/s) as a smoke test of the tool, not the kernels; kernel numbers "
              "need an sm_90/sm_100 GPU (see docs/PERF.md).")
        gpu = "cpu"
    else:
        gpu = torch.cuda.get_device_name(device)
        try:
            be = mk.backend_for(device)
        except mk.BackendUnavailableError as e:
            be = f"none ({e})"
        print(f"GPU: {gpu} (capability {torch.cuda.get_device_capability(device)}); backend for this device: {be}")
    shapes = QUICK if quick else HEADLINE
    if args.shapes:
        keep = set(args.shapes)
        shapes = [s for s in shapes if s[0] in keep]
    builtin_ops = [o for o in args.ops if o in OPS]
    fam_ops = [o for o in args.ops if o in families]
    prog = Progress(len(shapes) if builtin_ops else 0)
    ctx = BenchContext(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, quick=quick,
                       reps=args.reps, warmup=args.warmup, sets=args.sets, no_ref=args.no_ref,
                       peers=find_peers(args.peers), shapes=set(args.shapes) if args.shapes else None,
                       progress=prog, ref_reps=args.ref_reps, b2b=args.b2b, warm_s=args.warm_s)
    if args.b2b:
        print(f"timing: {args.b2b} calls back to back per sample (no synchronize between them), as FlashMLA's "
              "binary times itself")
    if builtin_ops and not shapes:
        print(f"note: none of --shapes {','.join(args.shapes)} is a {'quick' if quick else 'GPU'} shape; "
              f"{'use --quick for quick-a/quick-b' if not quick else 'the CPU runs quick-a/quick-b only'}")
    rows = builtin_rows(ctx, builtin_ops, shapes, prog) if builtin_ops else []
    prog.n_shapes = 0
    for name in fam_ops:
        print(f"-- {name}: tools/bench_{name}.py")
        for r in families[name].bench_rows(ctx):
            missing = {"op", "shape", "impl", "ms"} - set(r)
            if missing:
                raise ValueError(f"tools/bench_{name}.py returned a row without {sorted(missing)}: {r}")
            r.setdefault("flops", None)
            r.setdefault("family", name)
            rows.append(r)
    print_tables(rows, device)
    meta = dict(gpu=gpu, torch=torch.__version__, date=time.strftime("%Y-%m-%d"), commit=_commit(), reps=args.reps,
                warmup=args.warmup, sets=args.sets, quick=quick, b2b=args.b2b, warm_s=args.warm_s,
                what="PyTorch reference on the CPU (smoke test; GFLOP/s)" if device.type == "cpu" else "GPU kernels")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        print(f"wrote {args.json}")
    if args.plot and rows:
        plot(rows, args.plot, f"mla_kernels on {gpu} -- {meta['date']}, commit {meta['commit']}, "
                              f"median of {args.reps} runs", device)
    return rows


def main(argv=None, family_dirs=None):
    families = load_families(family_dirs)
    ap = build_parser(families)
    args = ap.parse_args(argv)
    if args.reps < 20:
        ap.error("--reps must be >= 20 (median of many runs)")
    if args.ref_reps < 20:
        ap.error("--ref-reps must be >= 20")
    if args.warmup < 0 or args.sets < 1:
        ap.error("--warmup must be >= 0 and --sets >= 1")
    if args.warm_s < 0:
        ap.error("--warm-s must be >= 0")
    if args.b2b < 0:
        ap.error("--b2b must be >= 0 (0: one synchronized call per sample)")
    return run(args, families)


if __name__ == "__main__":
    main()
