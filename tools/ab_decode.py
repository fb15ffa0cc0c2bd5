#!/usr/bin/env python3
"""Interleaved A/B timing of decode variants in one process (GPU only): CUDA-graph replays.

  python tools/ab_decode.py --variant new=. --variant base=.var/base \
      --variant "bf16=.@MLA_KERNELS_DECODE_PARTS=bf16" --variant "s32=.@splits=32" \
      [--cases v32-b1-sq1-h128,b128-sq1-h64] [--rounds 40]

Each ``NAME=DIR[@K=V;K=V]`` names a directory holding a ``mla_kernels`` package (this checkout,
or a patched copy such as the phase-dropping variants of ``tools/decode_variants.py``), imported
under its own module name (``tools/ab_bench.load_variant``); ``K=V`` pairs are environment knobs
set while that variant's plan is made (``MLA_KERNELS_DECODE_*``) or ``splits=N`` (the plan's forced
split count).  Cases and inputs are ``tools/bench_decode.py``'s (paged 32k-token sequences, page
64, block table, one cache for all).  Per case, every variant's step is captured in one CUDA graph
per input set; then, round after round, each variant replays one graph (the order rotates every
round), timed with CUDA events -- the GPU time of a graph-captured decode step, with the clock and
power drift shared by all variants.  Prints the median us per variant, the median of the per-round
ratios against the first variant, the largest deviation of each variant's output from the
first variant's (a patched variant that drops a phase is expected to differ) and whether its
output and lse equal the first variant's bit for bit (``MLA_KERNELS_DECODE_PAGEDIV=generic`` vs
``magic``: they must).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def parse_spec(spec: str):
    name, _, rest = spec.partition("=")
    root, _, opts = rest.partition("@")
    env, splits = {}, None
    for kv in filter(None, opts.split(";")):
        k, _, v = kv.partition("=")
        if k == "splits":
            splits = int(v)
        else:
            env[k] = v
    if not name or not root:
        raise SystemExit(f"--variant wants NAME=DIR[@K=V;...], got {spec!r}")
    return name, root, env, splits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True, metavar="NAME=DIR[@K=V;...]")
    ap.add_argument("--cases", default="v32-b1-sq1-h128", help="comma-separated tools/bench_decode.py case names")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--sets", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="time eager calls instead of graph replays")
    ap.add_argument("--b2b", type=int, default=1, metavar="K",
                    help="per sample, K steps back to back between one event pair (input sets rotating), "
                         "reported per step: the GPU is fed ahead of itself, so the host's launch of the "
                         "graph is not timed (FlashMLA's binary launches back to back too); 1 = one step "
                         "per event pair after a sync (the host's graph launch inside the time)")
    ap.add_argument("--graph-steps", type=int, default=1, metavar="G",
                    help="steps captured in one CUDA graph (input sets rotating; times reported per step): "
                         "consecutive steps then follow each other inside a graph, as the layers of a "
                         "serving engine's captured model step do, instead of across graph launches "
                         "(what a programmatic dependent launch between steps needs; docs/PERF.md)")
    args = ap.parse_args(argv)
    if args.graph_steps < 1:
        ap.error("--graph-steps wants G >= 1")
    if args.b2b < 1:
        ap.error("--b2b wants K >= 1")

    import torch

    if not torch.cuda.is_available():
        print("ab_decode: needs a CUDA GPU")
        return 2
    import ab_bench

    specs = [parse_spec(s) for s in args.variant]
    mods, by_root = {}, {}
    for name, root, _, _ in specs:
        # variants of one directory differ only in knobs read when a plan is made: one import
        # (and one compile per kernel configuration) serves them all
        if root not in by_root:
            by_root[root] = ab_bench.load_variant(name, root)
        mods[name] = by_root[root]
    import bench_decode as bd  # after the variants: its own `import mla_kernels` is unused here

    cases = {c[0]: c for c in bd.CASES + bd.EXTRA + bd.QUICK}
    want = [c for c in args.cases.split(",") if c]
    for c in want:
        if c not in cases:
            ap.error(f"unknown case {c!r}; choose from {', '.join(cases)}")
    dev = torch.device("cuda")
    print(f"GPU: {torch.cuda.get_device_name(dev)}; variants: {', '.join(s[0] for s in specs)}; "
          f"{'eager' if args.eager else 'graph'} steps, {args.b2b} back to back per sample"
          f"{'' if args.eager or args.graph_steps == 1 else f', {args.graph_steps} steps per graph'}", flush=True)
    max_b = max(cases[c][1] for c in want)
    seq_len, page_size = cases[want[0]][5], cases[want[0]][6]
    kv, bt_all = bd.make_cache(max_b, seq_len, page_size, dev, torch.bfloat16)
    sm_scale = bd.D_QK ** -0.5
    for cname in want:
        _, b, s_q, h_q, topk, _, _ = cases[cname]
        sets = bd.make_sets(args.sets, b, s_q, h_q, topk, seq_len, dev, torch.bfloat16)
        bt = bt_all[:b].contiguous()
        steps, outs, nsplit, keep = {}, {}, {}, []
        for name, _, env, splits in specs:
            mk = mods[name]
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                plan = mk.decode_plan(b, s_q, h_q, topk, device=dev, num_splits=splits)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            nsplit[name] = plan.num_splits
            keep.append(plan)  # a captured graph writes into the plan's buffers: keep them alive

            def call(i, mk=mk, plan=plan, sets=sets):
                q, pos = sets[i]
                return mk.sparse_mla_decode(q, kv, pos, sm_scale, bd.D_V, block_table=bt, plan=plan)

            call(0)
            torch.cuda.synchronize()
            res = call(0)
            outs[name] = (res[0].float().clone(), res[1].clone())
            if args.eager:
                steps[name] = call
            else:
                if args.graph_steps == 1:
                    graphs = bd.capture_graphs(call, args.sets)
                else:
                    def multi(i, call=call, g=args.graph_steps, n=args.sets):
                        for k in range(g):
                            call((i + k) % n)

                    graphs = bd.capture_graphs(multi, args.sets)
                steps[name] = lambda i, graphs=graphs: graphs[i].replay()
        names = [s[0] for s in specs]
        times = {n: [] for n in names}
        ratios = {n: [] for n in names}
        for r in range(args.warmup + args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            this = {}
            for n in order:
                a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for k in range(args.b2b):
                    steps[n]((r + k) % args.sets)
                e.record()
                e.synchronize()
                this[n] = a.elapsed_time(e) * 1e3 / (args.b2b * args.graph_steps)
            if r >= args.warmup:
                for n in names:
                    times[n].append(this[n])
                    ratios[n].append(this[n] / this[names[0]])
        ref_out, ref_lse = outs[names[0]]
        fl = bd.flops(b, s_q, h_q, topk)
        byts = bd.gathered_bytes(b, s_q, topk)
        for n in names:
            us = statistics.median(times[n])
            q1, _, q3 = statistics.quantiles(times[n], n=4)
            o, lse = outs[n]
            dev_max = (o - ref_out).abs().max().item()
            scale = ref_out.abs().max().item() or 1.0
            same = torch.equal(o, ref_out) and torch.equal(lse, ref_lse)
            print(f"{cname:<20} {n:<12} splits {nsplit[n]:3d} {us:8.2f} us  IQR {q1:.2f}-{q3:.2f}  "
                  f"{fl / us / 1e6:7.1f} TFLOPS  {byts / us / 1e3:7.0f} GB/s  ratio vs {names[0]}: "
                  f"{statistics.median(ratios[n]):.4f}  max|d out| {dev_max / scale:.2e}  "
                  f"{'bitwise (out, lse)' if same else 'outputs differ'}", flush=True)
        torch.cuda.synchronize()
        del steps, outs, sets, keep
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
