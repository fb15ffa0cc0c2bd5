#!/usr/bin/env python3
"""Nsight Compute of the indexer's select (top-k) kernel: the score kernel fills the workspace of
the chosen row blocks of one ``indexer_topk`` call (``tools/bench_indexer.py``'s inputs: one causal
sequence of S tokens, h_idx 64, d_idx 128, topk 2048), then ONE select launch per block runs
inside ``cudaProfilerStart/Stop`` (each block's default variant, ``indexer_host.topk_variant``).

Profile (GPU):

  ncu --clock-control none --set full --import-source yes --profile-from-start off \\
      -k regex:IndexerTopk -o OUT/topk python tools/prof_indexer_topk.py --seq 32768 --blocks 0,3,7

Export there: ``python tools/prof_decode.py --dump-report OUT/topk.ncu-rep --out-dir DIR`` (per-PC
samples, one ``pcs_<k>.csv`` per profiled block) and ``ncu --import OUT/topk.ncu-rep --page details``.

Read (anywhere): ``python tools/prof_indexer_topk.py --read DIR/pcs_0.csv ...`` -- stall samples
by reason and by instruction class, and the top SASS lines (``prof_indexer_loss``'s reader).
``--time`` (outside ncu): each block's select timed alone (median of ``--reps``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))


def profile(args) -> None:
    import torch

    from mla_kernels.api_indexer import make_indexer_problem
    from mla_kernels.common import host
    from mla_kernels.sm90 import indexer_host as ih
    from prof_indexer_loss import setup

    _, dev, S, topk, scale, s = setup(args)
    p = make_indexer_problem(s["q"], s["k"], s["w"], sm_scale=scale)
    q2, k, w_eff, ks = ih._score_inputs(p)
    rows = ih.block_rows(S, S)
    blocks = [int(b) for b in args.blocks.split(",")]
    idx = torch.empty(S, topk, dtype=torch.int32, device=dev)
    ln = torch.empty(S, dtype=torch.int32, device=dev)
    dummy = host.dummy(torch.float32, dev, (1, 1))
    nh = ih.no_hist(dev)
    score = ih._score_fn(p)
    work = []
    for b in blocks:
        q0 = b * rows
        n = min(rows, S - q0)
        ws = torch.empty(n, S, dtype=torch.float32, device=dev)
        score(q2, k, w_eff, ks, p.k_start, p.k_end, ws, nh, q0, S)
        name = ih.topk_variant(ih.block_longest(p, q0, n), topk)
        sel = ih._topk_fn(p, False, "", name)
        work.append((b, q0, n, ws, name, sel))
    torch.cuda.synchronize()

    def run(w):
        b, q0, n, ws, name, sel = w
        sel(ws, p.k_start, p.k_end, idx, ln, dummy, nh, q0)

    for w in work:
        for _ in range(args.warmup):
            run(w)
    torch.cuda.synchronize()
    print(f"GPU: {torch.cuda.get_device_name()}; S {S}, topk {topk}, blocks of {rows} rows: "
          + ", ".join(f"block {w[0]} (rows {w[1]}..{w[1] + w[2] - 1}, variant {w[4]})" for w in work), flush=True)
    if args.time:
        for w in work:
            ts = []
            for _ in range(args.reps):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                run(w)
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1))
            print(f"  block {w[0]} select ({w[4]}): median {statistics.median(ts):.4f} ms over {args.reps}", flush=True)
        return
    torch.cuda.profiler.start()
    for w in work:
        run(w)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from prof_indexer_loss import dispatch, input_args, read_args

    input_args(ap)
    ap.add_argument("--blocks", default="0,3,7", help="row blocks (indexer_host.block_rows rows each) to profile")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--time", action="store_true", help="time each block's select instead of profiling")
    read_args(ap)
    return dispatch(ap.parse_args(argv), profile)


if __name__ == "__main__":
    sys.exit(main())
