#!/usr/bin/env python3
"""Run the sm90 indexer kernels (scores bf16 / fp8, the top-k kernel on every path of its
selection -- rows held in shared memory and rows read from global memory --, loss forward (every
variant), backward with atomic / bulk-reduce dk and every deterministic dk mode) under
compute-sanitizer's memcheck, racecheck and synccheck.

  python tools/sanitize_indexer.py [--tools memcheck,racecheck,synccheck] [--log-dir DIR]

The workload (``--workload``: what each sanitized process runs) uses small problems through the
public API with ``MLA_KERNELS_BACKEND=sm90`` forced, prints BEGIN/END markers around each step
and checks every result against the reference, so a kernel that did not run (or ran wrong) under
a tool shows up too.  Output: per (step, tool) the number of error / warning records the tool
printed between the markers, then each tool's summary line.  Records of ``cuGetProcAddress``
(cuda-python probing driver entry points, before any kernel) are counted apart as API probes.
Exit 1 if anything was reported or a check failed; 2 without a GPU or compute-sanitizer.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sanitize  # noqa: E402  (the log parser, the sanitizer lookup and options)

TOOLS = ("memcheck", "racecheck", "synccheck")
MARK = "@@SANITIZE_INDEXER"
#: ``--only``: comma-separated substrings of the step names to run (the workload reads it)
ENV_ONLY = "SANITIZE_INDEXER_ONLY"


def workload() -> int:
    """The steps, each checked against the reference; returns the number of failed checks."""
    import torch

    import mla_kernels as mk
    from mla_kernels import reference as ref
    from mla_kernels.sm90 import indexer_host

    os.environ["MLA_KERNELS_BACKEND"] = "sm90"
    g = torch.Generator().manual_seed(0)
    fails = 0

    only = [x for x in os.environ.get(ENV_ONLY, "").split(",") if x]

    def step(name, fn):
        nonlocal fails
        if only and not any(x in name for x in only):
            return
        print(f"{MARK} BEGIN {name}", flush=True)
        try:
            ok = bool(fn())
            torch.cuda.synchronize()
        except Exception as e:  # a kernel that cannot run is a failure
            ok = False
            print(f"{MARK} exception {type(e).__name__}: {e}", flush=True)
        fails += not ok
        print(f"{MARK} END {name} | check: {'ok' if ok else 'FAILED'}", flush=True)

    s_q, s_kv, h, d = 150, 700, 64, 128
    qi = torch.randint(-2, 3, (s_q, h, d), generator=g).float()
    ki = torch.randint(-2, 3, (s_kv, d), generator=g).float()
    wi = torch.randint(-1, 3, (s_q, h), generator=g).float().cuda()
    ks = torch.randint(-5, s_kv, (s_q,), generator=g).int().cuda()
    ke = (ks + torch.randint(0, s_kv, (s_q,), generator=g).int().cuda())
    for fp8 in (False, True):
        dt = torch.float8_e4m3fn if fp8 else torch.bfloat16
        q, k = qi.to(dt).cuda(), ki.to(dt).cuda()
        sc = dict(q_scale=torch.full((s_q, h), 0.5, device="cuda"), k_scale=torch.full((s_kv,), 2.0, device="cuda")) \
            if fp8 else {}
        tag = "fp8" if fp8 else "bf16"

        def logits(q=q, k=k, sc=sc):
            got = mk.indexer_logits(q, k, wi, sm_scale=0.5, k_start=ks, k_end=ke, **sc)
            want = ref.indexer_logits_ref(q, k, wi, 0.5, ks, ke, sc.get("q_scale"), sc.get("k_scale"))
            return torch.equal(got, want.float())

        def topk(q=q, k=k, sc=sc):
            got = mk.indexer_topk(q, k, wi, 96, sm_scale=0.5, return_logits=True, **sc)
            want = ref.indexer_topk_ref(q, k, wi, 96, 0.5, None, None, sc.get("q_scale"), sc.get("k_scale"), True)
            return all(torch.equal(a, b.to(a.dtype)) for a, b in zip(got, want))

        step(f"score+topk logits {tag}", logits)

        def logits_opt(q=q, k=k, sc=sc, env=None):
            # the score kernel's opt-ins: ping-pong (same arithmetic: exact), packed bf16x2 head sum
            # (within bf16 rounding: 2^-6 of the largest |logit|)
            os.environ[env[0]] = env[1]
            try:
                got = mk.indexer_logits(q, k, wi, sm_scale=0.5, k_start=ks, k_end=ke, **sc)
            finally:
                os.environ.pop(env[0], None)
            want = ref.indexer_logits_ref(q, k, wi, 0.5, ks, ke, sc.get("q_scale"), sc.get("k_scale")).float()
            if env[1] == "1":
                return torch.equal(got, want)
            fin = torch.isfinite(want)
            if not torch.equal(torch.isneginf(got), torch.isneginf(want)):
                return False
            return bool(((got - want)[fin].abs().max() <= 2.0 ** -6 * want[fin].abs().max()).item())

        step(f"score+topk logits {tag} pingpong", lambda: logits_opt(env=(indexer_host.ENV_SCORE_PINGPONG, "1")))
        step(f"score+topk logits {tag} headsum=bf16x2",
             lambda: logits_opt(env=(indexer_host.ENV_SCORE_HEADSUM, "bf16x2")))
        step(f"score+topk topk {tag}", topk)  # the default fused-histogram mode
        for mode in ("0",) + indexer_host.HIST_MODES:  # the row pass and every counting mode
            def topk_mode(q=q, k=k, sc=sc, mode=mode):
                os.environ[indexer_host.ENV_TOPK_HIST] = mode
                try:
                    return topk(q, k, sc)
                finally:
                    os.environ.pop(indexer_host.ENV_TOPK_HIST, None)

            step(f"score+topk topk {tag} hist={mode}", topk_mode)

    def select_paths(variant=None):
        ld, topk = 6000, 100
        rows = torch.randn(7, ld, generator=g)
        rows[0] = 0.0  # threshold bin over the shared candidate buffer: refined by row passes
        rows[1] = torch.randint(0, 4, (ld,), generator=g).float()  # ties, candidates in smem
        rows[2, 7: 7 + topk] = 50.0  # first digit's bin taken whole
        # 4,095 keys in the threshold bin, 257 per warp segment of 384 keys: 143 candidate chunks,
        # more than the buffer holds (the row falls back to the heavy-ties passes)
        rows[6] = -1.0 - torch.rand(ld, generator=g)
        for w in range(16):
            c = min(257, ld - w * 384)
            rows[6, w * 384: w * 384 + c] = 1.0 + 0.2 * torch.rand(c, generator=g)
        start = torch.tensor([0, 0, 0, 3, 5, 0, 0], dtype=torch.int32)
        end = torch.tensor([ld, ld, ld, ld - 1, 5 + topk, 50, ld], dtype=torch.int32)  # short rows too
        got = indexer_host.select_rows(rows.cuda(), start.cuda(), end.cuda(), topk, True, variant=variant)
        for t in range(7):  # the definition, on the rows themselves
            a, b = int(start[t]), int(end[t])
            r = rows[t, a:b]
            order = sorted(range(b - a), key=lambda i: (-float(r[i]), i))[:topk]
            want = sorted(a + i for i in order)
            gi = got[0][t].cpu()
            if gi[: len(want)].tolist() != want or (gi[len(want):] != -1).any() or int(got[1][t]) != len(want):
                return False
        return True

    step("topk select paths", select_paths)  # the default variant for rows of 6000 keys
    for name in indexer_host.TOPK_VARIANTS:  # every select variant
        step(f"topk select paths {name}", lambda name=name: select_paths(name))
    # rows of at most 3008 keys in shared memory, the longer ones by the global path, in one launch
    step("topk select paths row_cap=3008", lambda: select_paths((3008, 4, 0, 8192, 0, False)))

    s_q, s_kv, topk = 60, 500, 200
    q = (torch.randn(s_q, 64, 128, generator=g) / 4).bfloat16().cuda()
    k = (torch.randn(s_kv, 128, generator=g) / 4).bfloat16().cuda()
    w = (torch.randn(s_q, 64, generator=g) / 8).cuda()
    idx = torch.randint(-2, s_kv, (s_q, topk), generator=g).int().cuda()
    idx[3] = -1
    tgt = torch.rand(s_q, topk, generator=g).cuda()
    tl = torch.randint(0, topk + 1, (s_q,), generator=g).int().cuda()
    gr = torch.randn(s_q, generator=g).cuda()
    _, lse, inv = ref.indexer_loss_fwd_ref(q.float(), k.float(), w, idx, tgt, 0.1, tl)
    want = ref.indexer_loss_bwd_ref(q.float(), k.float(), w, idx, tgt, gr, lse, inv, 0.1, tl)

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))

    def loss_fwd(var=""):
        if var:
            os.environ[indexer_host.ENV_LOSS_FWD] = var
        try:
            rows = mk.indexer_loss(q, k, w, idx, tgt, sm_scale=0.1, topk_length=tl, reduction="none")
        finally:
            os.environ.pop(indexer_host.ENV_LOSS_FWD, None)
        return rel(rows, ref.indexer_loss_fwd_ref(q.float(), k.float(), w, idx, tgt, 0.1, tl)[0]) < 1e-4

    step("loss fwd", loss_fwd)  # the default variant
    for var in indexer_host.LOSS_FWD_VARIANTS:
        step(f"loss fwd variant={var}", lambda var=var: loss_fwd(var))
    modes = (("red", False), ("bulk", False), ("red_bf16", False), ("fixed_bulk", True), ("fixed_bulk2", True), ("fixed_bulk64", True),
             ("fixed_bulk32x2", True), ("fixed_red", True), ("slots", True), ("grouped", True),
             ("grouped_waves", True))
    for mode, det in modes:
        def loss_bwd(mode=mode, det=det):
            os.environ[indexer_host.ENV_DK] = mode if mode in ("bulk", "red_bf16") else "red"
            os.environ[indexer_host.ENV_DET] = ("grouped" if mode == "grouped_waves" else mode) if det else "fixed_bulk64"
            # grouped_waves: 4 waves of 16 queries (a 1 MiB workspace)
            os.environ[indexer_host.ENV_DET_WS] = "1" if mode == "grouped_waves" else ""
            qq, kk, ww = (x.clone().requires_grad_(True) for x in (q, k, w))
            rows = mk.indexer_loss(qq, kk, ww, idx, tgt, sm_scale=0.1, topk_length=tl, reduction="none",
                                   deterministic=det)
            (rows * gr).sum().backward()
            return all(rel(a.float(), b.float()) < 1e-2 for a, b in zip((qq.grad, kk.grad, ww.grad), want))

        step(f"loss bwd dk={mode}", loss_bwd)
    return fails


def parse(text):
    """Per step: [errors, warnings, api probes, check]; the summary line; records outside steps
    (``tools/sanitize.py``'s parser with this tool's markers)."""
    per, summary, stray, probes = sanitize.parse_log(text, "", mark=MARK)
    return ({k: [t.errors, t.warnings, t.api_probe, t.check] for k, t in per.items()}, summary, stray, probes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--log-dir", default="sanitize-indexer-logs")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--workload", action="store_true", help="run the steps in-process (no sanitizer)")
    ap.add_argument("--only", default="", help="comma-separated substrings: run only the steps whose names "
                                                "contain one (e.g. 'topk' or 'loss bwd')")
    args = ap.parse_args(argv)
    if args.only:
        os.environ[ENV_ONLY] = args.only
    if args.workload:
        return 1 if workload() else 0
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("sanitize_indexer: needs an sm_90 GPU; none here")
        return 2
    san = sanitize.find_sanitizer()
    if san is None:
        print("sanitize_indexer: compute-sanitizer not found")
        return 2
    os.makedirs(args.log_dir, exist_ok=True)
    tools = [t for t in args.tools.split(",") if t]

    def run(tool):
        cmd = [san] + sanitize.tool_args(tool) + [sys.executable, os.path.abspath(__file__), "--workload"]
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                               env=dict(os.environ, PYTHONUNBUFFERED="1"))
            text, rc = p.stdout + p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            text, rc = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else "", -1
        with open(os.path.join(args.log_dir, f"{tool}.log"), "w") as f:
            f.write(text)
        return tool, text, rc, time.time() - t0

    bad = 0
    with ThreadPoolExecutor(max_workers=len(tools)) as pool:
        for tool, text, rc, secs in pool.map(run, tools):
            per, summary, stray, probes = parse(text)
            for name, (err, warn, _, chk) in per.items():
                bad += bool(err or warn or chk != "ok")
                print(f"{name:<28} {tool:<9} {err:>5} errors {warn:>5} warnings  check {chk}")
            clean = sanitize.summary_clean(summary, probes) and not stray
            bad += not clean
            print(f"{'(whole process)':<28} {tool:<9} rc={rc} {secs:.0f}s  {summary}  api-probes={probes}"
                  f"{'  stray: ' + stray[0] if stray else ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
