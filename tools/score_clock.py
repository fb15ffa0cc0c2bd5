#!/usr/bin/env python3
"""The indexer score kernel's sustained clock and power: each variant runs back to back for
``--secs`` seconds over all row blocks of one causal S-token call (``tools/bench_indexer.py``'s
inputs) while ``nvidia-smi`` samples the SM clock and the board power every ``--ms`` ms.

  python tools/score_clock.py [--seq 32768] [--secs 3] [--variants full,mma] [--dtypes bf16,fp8]

Variants: ``full`` (the kernel as shipped), ``mma`` (a timing copy: the key tiles' MMAs and the
pipeline alone, wrong outputs), ``bf16x2`` (the opt-in packed head sum).  Per variant: ms per
call (the mean over the sustained loop, after ``--warm`` s of the same loop), the mean SM clock
and power of the samples taken during the timed part.  Whether a gap between ``full`` and ``mma``
is issue time at the same clock or a lower clock at the power cap (the H200 caps at 700 W) is
what this separates.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

VARIANTS = {"full": dict(), "mma": dict(profile="mma"), "bf16x2": dict(head_sum="bf16x2")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from prof_indexer_loss import input_args

    input_args(ap)
    ap.add_argument("--secs", type=float, default=3.0)
    ap.add_argument("--warm", type=float, default=1.0)
    ap.add_argument("--ms", type=int, default=50)
    ap.add_argument("--variants", default="full,mma")
    ap.add_argument("--dtypes", default="bf16,fp8")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("score_clock: needs a CUDA GPU (it times the sm90 score kernel and samples nvidia-smi)", flush=True)
        return 2
    from mla_kernels import _compile
    from mla_kernels.api_indexer import make_indexer_problem
    from mla_kernels.sm90 import indexer_host as ih
    from mla_kernels.sm90.indexer_score import compile_score
    from prof_indexer_loss import setup

    bi, dev, S, _, scale, s = setup(args)
    arch = _compile.arch_for_device(torch.device(dev))
    rows = ih.block_rows(S, S)
    ws = torch.empty(rows, S, dtype=torch.float32, device=dev)
    nh = ih.no_hist(dev)
    print(f"GPU: {torch.cuda.get_device_name()}; S {S}, h_idx {bi.H}, d_idx {bi.D}: score kernel over "
          f"{-(-S // rows)} row blocks, {args.secs} s per variant after {args.warm} s", flush=True)
    for dt in args.dtypes.split(","):
        fp8 = dt == "fp8"
        if fp8:
            p = make_indexer_problem(s["q"].to(torch.float8_e4m3fn), s["k"].to(torch.float8_e4m3fn), s["w"],
                                     sm_scale=scale, q_scale=torch.ones(S, bi.H, device=dev),
                                     k_scale=torch.ones(S, device=dev))
        else:
            p = make_indexer_problem(s["q"], s["k"], s["w"], sm_scale=scale)
        q2, k, w_eff, ks = ih._score_inputs(p)
        for name in args.variants.split(","):
            _, fn = compile_score(fp8, bi.H, bi.D, arch, **VARIANTS[name])

            def call(fn=fn):
                for q0 in range(0, S, rows):
                    fn(q2, k, w_eff, ks, p.k_start, p.k_end, ws[: min(rows, S - q0)], nh, q0, S)

            call()
            torch.cuda.synchronize()
            t_end = time.time() + args.warm
            while time.time() < t_end:
                call()
                torch.cuda.synchronize()
            smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                    f"-lms={args.ms}"], stdout=subprocess.PIPE, text=True)
            n = 0
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t_end = time.time() + args.secs
            e0.record()
            while time.time() < t_end:
                for _ in range(4):
                    call()
                n += 4
                torch.cuda.synchronize()
            e1.record()
            e1.synchronize()
            smi.terminate()
            out = smi.communicate()[0]
            samples = []
            for line in out.splitlines():
                try:
                    c, w = (float(x) for x in line.split(","))
                    samples.append((c, w))
                except ValueError:
                    pass
            samples = samples[2:] or samples  # the first samples may precede the loop
            clk = sum(c for c, _ in samples) / max(len(samples), 1)
            pw = sum(w for _, w in samples) / max(len(samples), 1)
            print(f"  {dt:<5} {name:<7} {e0.elapsed_time(e1) / n:8.3f} ms per call ({n} calls)   "
                  f"SM clock {clk:6.0f} MHz   power {pw:5.0f} W   ({len(samples)} samples)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
