#!/usr/bin/env python3
"""Where the sm90 backward's time goes, block by block: a timing trace of its warpgroups (GPU only).

  python tools/trace_bwd.py [--s-kv 8192,32768] [--h-q 128] [--s-q 4096] [--topk 2048] [--reps 10]

The backward compiled with ``trace=True`` (``sm90/bwd.py``: the same kernel plus one predicated
``%clock`` store per event, by one thread of each role) records, for every CTA and each of its
first 32 blocks, the SM cycle counter at the events of its three roles -- WG0 (S, P, dQ, its
dKV chunks), WG1 (dP, dS, dQ, its dKV chunks) and the producer (the gather) -- into a
``[s_q, h_q / 64, 2048]`` int32 buffer passed as the (unused) attn_sum argument.  The tool:

1. times the untraced and the traced backward (CUDA events, median of ``--reps`` calls) -- the
   trace's own cost;
2. prints, for the steady-state blocks (2 .. n-3) of all CTAs, the median cycle offset of every
   event from WG0's loop top of the same block (one block's timeline), the median block period,
   and the median of each interval between consecutive events of a role (each role's cycle
   counter shifted onto WG0's by their readings right after the CTA's first barrier: warps of one
   CTA may read different counters);
3. prints the skew between the two CTAs of each head-block pair (h_q % 128 == 0): the
   difference of their WG0 loop tops per block, each CTA's clock taken from its start stamp
   (both stamp right after the cluster barrier).

A measurement tool (docs/PERF.md, the backward chapter), not part of the package.  Exits 2
without a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

# "at BAR_x": the stamp right after a named-barrier sync reads the warp's *arrival* there (ptxas
# emits BAR.SYNC.DEFER_BLOCKING: the warp blocks only at its next memory instruction, and the
# cycle-counter read is not one); the release is the partner's event ("dS stored", "P stored").
WG0_EVENTS = ["top", "kv_a ready", "kv_b ready", "kv_c ready", "S done", "P stored", "at BAR_DS",
              "dQ done"] + [f"{k} c{c}" for c in range(4) for k in ("send", "recv", "scattered")]
WG1_EVENTS = (["top", "kv_a ready", "kv_b ready", "kv_c ready", "dP done", "at BAR_P", "dS stored", "dQ done"]
              + [f"send c{c}" for c in range(5)] + [f"recv c{c}" for c in range(5)] + ["dKV end"])
PROD_EVENTS = ["top", "indices in", "A free", "A+B issued", "meta", "C free (drained)", "C issued"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--s-kv", default="8192,32768")
    ap.add_argument("--h-q", type=int, default=128)
    ap.add_argument("--s-q", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--d-qk", type=int, default=576)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--save", default="", help="PREFIX: save the raw trace of every k-th token's CTAs (~512) to PREFIX_<s_kv>.npz")
    ap.add_argument("--load", default="", help="FILE.npz: analyse a saved trace (no GPU needed) and exit")
    args = ap.parse_args(argv)

    if args.load:
        import numpy as np

        from mla_kernels.sm90 import bwd as bwd_mod

        analyse(np.load(args.load)["trace"].astype(np.int64), args.h_q // 64, bwd_mod)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("trace_bwd: no CUDA device (this tool runs the backward on a GPU)")
        return 2
    import numpy as np

    import bench
    import mla_kernels as mk
    from mla_kernels.common import host
    from mla_kernels.sm90 import Sm90Backend, compile_bwd
    from mla_kernels.sm90 import bwd as bwd_mod

    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(0)}")
    d_v = 512
    sm_scale = args.d_qk ** -0.5
    n_hblk = args.h_q // 64
    slots = args.topk
    if slots < bwd_mod.TRACE_SLOTS:
        slots = bwd_mod.TRACE_SLOTS
    orig_compile, orig_name, orig_dummy = Sm90Backend.compile_bwd, Sm90Backend.bwd_name, host.dummy

    for s_kv in (int(x) for x in args.s_kv.split(",")):
        s = bench.make_sets(1, args.s_q, args.h_q, args.topk, args.d_qk, d_v, s_kv, dev, torch.bfloat16)[0]
        out, _, lse = mk.sparse_mla_fwd(s["q"], s["kv"], s["idx"], sm_scale, d_v)
        dout = torch.randn_like(out)

        def call():
            return mk.sparse_mla_bwd(s["q"], s["kv"], out, dout, s["idx"], lse, sm_scale, d_v)

        Sm90Backend.compile_bwd, Sm90Backend.bwd_name, host.dummy = orig_compile, orig_name, orig_dummy
        ms_plain = bench.time_fn(lambda i: call(), 1, 3, args.reps, dev)[0]

        buf = torch.zeros(args.s_q, n_hblk, slots, dtype=torch.int32, device=dev)
        Sm90Backend.compile_bwd = staticmethod(lambda *a, **k: compile_bwd(*a, trace=True, **k))
        Sm90Backend.bwd_name = "SparseMlaBwdSm90Trace"

        def dummy(dtype, device, shape=(4,)):
            if dtype == torch.float32 and tuple(shape) == (1, 1, 64):
                return buf.view(torch.float32)
            return orig_dummy(dtype, device, shape)

        host.dummy = dummy
        ms_trace = bench.time_fn(lambda i: call(), 1, 2, args.reps, dev)[0]
        buf.zero_()
        call()
        torch.cuda.synchronize()
        Sm90Backend.compile_bwd, Sm90Backend.bwd_name, host.dummy = orig_compile, orig_name, orig_dummy

        flops = bench.flops("bwd", args.s_q, args.h_q, args.topk, args.d_qk, d_v)
        print(f"\n== s_q {args.s_q}, h_q {args.h_q}, topk {args.topk}, d_qk {args.d_qk}, s_kv {s_kv} ==")
        print(f"backward: {ms_plain:.3f} ms ({flops / ms_plain / 1e9:.1f} TFLOPS); traced: {ms_trace:.3f} ms "
              f"({ms_trace / ms_plain:.4f}x)")
        raw = np.asarray(buf.cpu()).astype(np.int64).reshape(args.s_q * n_hblk, slots)
        if args.save:
            # every k-th token's CTAs (whole head-block pairs), about 512 rows
            k = max(1, args.s_q // max(1, 512 // n_hblk))
            np.savez_compressed(f"{args.save}_{s_kv}.npz", trace=raw.reshape(args.s_q, n_hblk, slots)[::k].reshape(-1, slots))
        analyse(raw, n_hblk, bwd_mod)
    return 0


def analyse(t, n_hblk, bwd_mod):
    import numpy as np

    per, nblk, base, arrive = bwd_mod.TRACE_PER_BLOCK, bwd_mod.TRACE_BLOCKS, bwd_mod.TRACE_BASE, bwd_mod.TRACE_ARRIVE
    start, end, nb = t[:, bwd_mod.TRACE_START], t[:, bwd_mod.TRACE_END], t[:, bwd_mod.TRACE_NBLK]
    mod = 1 << 32

    def d(a, b):  # cycles from a to b (32-bit counter)
        return (b - a) % mod

    ok = nb >= 8
    rows = np.nonzero(ok)[0]
    if len(rows) == 0:
        print("no CTA with >= 8 blocks: nothing to analyse")
        return
    n_b = int(min(nb[rows].min(), nblk))
    blocks = range(2, n_b - 2)
    ev = {r: t[:, base[r]: base[r] + nblk * per].reshape(-1, nblk, per) for r in range(3)}
    # %clock is the SM's counter: the three roles' stamps compare directly.  Their readings right
    # after the CTA's first barrier are arrivals there (see WG0_EVENTS), so they differ a little.
    skew = [((t[i, arrive + r] - t[i, arrive]) + mod // 2) % mod - mod // 2 for i in rows for r in (1, 2)]
    print(f"arrival spread of the roles at the first barrier: median |d| {statistics.median(abs(x) for x in skew):.0f}"
          f" cycles")
    top0 = ev[0][:, :, 0]
    # the waits at the two hand-off barriers: from a warpgroup's arrival to its partner's event
    for what, (ra, ea), (rb, eb) in (("WG1 waits at BAR_P for WG0's P", (1, 5), (0, 5)),
                                     ("WG0 waits at BAR_DS for WG1's dS", (0, 6), (1, 6))):
        w = [max(0, ((ev[rb][i, b, eb] - ev[ra][i, b, ea] + mod // 2) % mod) - mod // 2) for i in rows for b in blocks]
        print(f"{what}: median {statistics.median(w):.0f} cycles, p90 {np.percentile(w, 90):.0f}")
    period = [d(top0[i, b], top0[i, b + 1]) for i in rows for b in blocks]
    life = [d(start[i], end[i]) for i in rows]
    print(f"CTAs {len(rows)}, blocks {n_b} recorded; median CTA life {statistics.median(life):.0f} cycles, "
          f"block period (WG0 top to top) median {statistics.median(period):.0f}, "
          f"p10 {np.percentile(period, 10):.0f}, p90 {np.percentile(period, 90):.0f}")
    names = {0: ("WG0", bwd_mod_events(0)), 1: ("WG1", bwd_mod_events(1)), 2: ("producer", bwd_mod_events(2))}
    print("\none block's timeline: median cycles from WG0's loop top (blocks 2..n-3, all CTAs);"
          " interval = median from the role's previous event")
    for r in range(3):
        label, evs = names[r]
        prev = None
        for e, name in enumerate(evs):
            col = ev[r][:, :, e]
            if not np.any(col[rows][:, list(blocks)]):
                continue
            offs = [((col[i, b] - top0[i, b] + mod // 2) % mod) - mod // 2 for i in rows for b in blocks]
            line = f"  {label:8s} {name:18s} {statistics.median(offs):8.0f}"
            if prev is not None:
                iv = [d(ev[r][i, b, prev], col[i, b]) for i in rows for b in blocks]
                line += f"   (+{statistics.median(iv):6.0f}, p90 {np.percentile(iv, 90):6.0f})"
            print(line)
            prev = e
    if n_hblk % 2 == 0:
        sk = []
        for i in rows:
            if i % n_hblk % 2 == 0 and ok[i + 1]:
                for b in blocks:
                    sk.append(abs(int(d(start[i], top0[i, b])) - int(d(start[i + 1], top0[i + 1, b]))))
        if sk:
            print(f"\npair skew |WG0 top(rank 0) - WG0 top(rank 1)| per block: median {statistics.median(sk):.0f}, "
                  f"p90 {np.percentile(sk, 90):.0f} cycles")


def bwd_mod_events(role):
    return (WG0_EVENTS, WG1_EVENTS, PROD_EVENTS)[role]


if __name__ == "__main__":
    sys.exit(main())
