#!/usr/bin/env python3
"""Nsight Compute of the indexer loss kernels: one ``indexer_loss`` forward + backward inside
``cudaProfilerStart/Stop`` after warm-up (the loss forward and backward launches), on
``tools/bench_indexer.py``'s inputs (one causal sequence of S tokens, h_idx 64, d_idx 128, topk
2048, ``indexer_topk``'s indices, softmax targets).

Profile (GPU):

  ncu --clock-control none --set full --profile-from-start off -k regex:IndexerLoss -c 2 -o OUT/loss \\
      python tools/prof_indexer_loss.py --seq 32768

Export there: ``ncu --import OUT/loss.ncu-rep --page details`` and ``--page source --csv
--print-source sass``; per-PC samples with ``tools/prof_decode.py --dump-report``.

Read (anywhere): ``python tools/prof_indexer_loss.py --read pcs_0.csv`` -- stall samples by reason
and by instruction class, and the top SASS lines (``prof_decode``'s reader without warp roles).
``--env NAME=VALUE`` (repeatable) sets a kernel option for the profiled call.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))


def input_args(ap) -> None:
    """The options :func:`setup` reads (``--seq``, ``--topk``, ``--env``), shared by the indexer's
    profiling tools."""
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE set before the calls")


def read_args(ap) -> None:
    """``--read`` (per-PC CSVs to summarise, no GPU) and ``--top``: see :func:`dispatch`."""
    ap.add_argument("--read", nargs="*", default=None, help="per-PC CSVs to summarise (no GPU)")
    ap.add_argument("--top", type=int, default=30)


def dispatch(args, profile) -> int:
    """:func:`read` the ``--read`` CSVs, or run ``profile(args)`` on the GPU."""
    if args.read is not None:
        read(args.read, args.top)
    else:
        profile(args)
    return 0


def setup(args):
    """``--env`` applied; ``(bench_indexer, device, S, topk, sm_scale, inputs)`` of
    ``tools/bench_indexer.py``'s first input set (shared with ``prof_indexer_topk.py``)."""
    import bench_indexer as bi

    for kv in args.env:
        name, _, val = kv.partition("=")
        os.environ[name] = val
    dev = "cuda"
    return bi, dev, args.seq, args.topk, bi.D ** -0.5, bi._inputs(args.seq, 1, dev)[0]


def profile(args) -> None:
    import torch

    import mla_kernels as mk

    _, dev, S, topk, scale, s = setup(args)
    idx, ln = mk.indexer_topk(s["q"], s["k"], s["w"], topk, sm_scale=scale)
    g = torch.Generator(device=dev).manual_seed(1)
    tgt = torch.softmax(torch.randn(S, topk, device=dev, generator=g), -1) * (idx >= 0)
    leaves = dict(q=s["q"].clone().requires_grad_(True), k=s["k"].clone().requires_grad_(True),
                  w=s["w"].clone().requires_grad_(True))

    def call():
        for x in leaves.values():
            x.grad = None
        loss = mk.indexer_loss(leaves["q"], leaves["k"], leaves["w"], idx, tgt, sm_scale=scale, topk_length=ln)
        loss.backward()
        return loss

    for _ in range(args.warmup):
        call()
    torch.cuda.synchronize()
    print(f"GPU: {torch.cuda.get_device_name()}; S {S}, topk {topk}: one loss forward + backward profiled",
          flush=True)
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def read(paths, top: int) -> None:
    from collections import Counter

    from prof_decode import instr_class, read_rows

    for path in paths:
        kernel, rows = read_rows(path)
        tot = sum(r["total"] for r in rows)
        print(f"== {path}: {kernel[:90]}  ({len(rows)} SASS lines, {tot:.0f} samples)")
        reasons, classes = Counter(), Counter()
        for r in rows:
            reasons.update(r["reasons"])
            classes[instr_class(r["sass"])] += r["total"]
        print("   by reason: " + ", ".join(f"{k} {v:.0f} ({100 * v / tot:.1f}%)"
                                            for k, v in reasons.most_common(12) if v))
        print("   by class: " + ", ".join(f"{k} {v:.0f} ({100 * v / tot:.1f}%)" for k, v in classes.most_common() if v))
        print(f"   top {top} lines:")
        for r in sorted(rows, key=lambda r: -r["total"])[:top]:
            if not r["total"]:
                break
            rs = ", ".join(f"{k} {v:.0f}" for k, v in r["reasons"].most_common(3) if v)
            print(f"     {r['pc']:#07x} {r['total']:7.0f} ({100 * r['total'] / tot:4.1f}%) {r['sass'][:72]}  <{rs}>")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    input_args(ap)
    ap.add_argument("--warmup", type=int, default=3)
    read_args(ap)
    return dispatch(ap.parse_args(argv), profile)


if __name__ == "__main__":
    sys.exit(main())
