#!/usr/bin/env python3
"""Decode benchmark: ``sparse_mla_decode`` with a plan on a paged bf16 KV cache.

Rows (issue #16): FlashMLA's V3.2 production case (h_q 128, s_q 2, topk 2048, 32k-token
sequences, page 64, b in {2, 64, 128}), b 1 at s_q 1 for h_q 128, and b in {1, 128} at s_q 1 for
h_q 16, 32, 64.  Per row: GPU time (us, CUDA events around one planned call -- decode kernel +
combine --, median of ``--reps`` after ``--warmup``, ``--sets`` input sets rotated), TFLOPS
(``2 b s_q h_q topk (d_qk + d_v)``, invalid slots counted), GB/s of gathered KV (``b s_q topk d_qk
2`` bytes) and its share of the GPU's HBM bandwidth; the split count; the host time of one
planned call without a graph (median wall time of the Python call); beside them:

* ``fwd_us`` -- the prefill forward kernel on the flattened tokens (what a decode step cost
  before the split path; h_q % 64 == 0 only);
* ``padded_us`` -- h_q < 64 run as h_q 64 (what FlashMLA / vLLM do today: pad the heads);
* ``graph_us`` -- the same step replayed from a CUDA graph: GPU time without host launch gaps
  (at small batches the eager timing waits for the host to launch the combine), one replay per
  event pair after a sync (the host's graph launch is inside it);
* ``graph_b2b_us`` -- per step, ``B2B`` graph replays back to back per event pair: the host runs
  ahead of the GPU (FlashMLA's binary's method: back-to-back launches), so only GPU time counts;
* ``flashmla_us`` -- FlashMLA's sm90 FP8 sparse decode (kernel + combine, its own timing: mean
  of 50 launches after 10 warm-ups) from ``.peers/anchors/flashmla/bench_sm90_decode`` when the
  binary is found (h_q 64 / 128 only).

``rows(args)`` returns the rows as dicts (``tools/bench.py --ops decode`` uses it); without a GPU
it runs tiny shapes on the CPU reference and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import mla_kernels as mk  # noqa: E402

D_QK, D_V = 576, 512
# (name, b, s_q, h_q, topk, seq_len, page_size)
CASES = [
    ("v32-b1-sq1-h128", 1, 1, 128, 2048, 32768, 64),
    ("v32-b2-sq2-h128", 2, 2, 128, 2048, 32768, 64),
    ("v32-b64-sq2-h128", 64, 2, 128, 2048, 32768, 64),
    ("v32-b128-sq2-h128", 128, 2, 128, 2048, 32768, 64),
    ("b1-sq1-h64", 1, 1, 64, 2048, 32768, 64),
    ("b128-sq1-h64", 128, 1, 64, 2048, 32768, 64),
    ("b1-sq1-h32", 1, 1, 32, 2048, 32768, 64),
    ("b128-sq1-h32", 128, 1, 32, 2048, 32768, 64),
    ("b1-sq1-h16", 1, 1, 16, 2048, 32768, 64),
    ("b128-sq1-h16", 128, 1, 16, 2048, 32768, 64),
]
# more shapes for ``--cases`` and tools/ab_decode.py (not in the default rows): one request with an MTP
# draft token (4 rows of 64 heads), b 4 at h_q 128, and row counts where the auto combine rule
# changes its choice
EXTRA = [
    ("v32-b1-sq2-h128", 1, 2, 128, 2048, 32768, 64),
    ("v32-b4-sq1-h128", 4, 1, 128, 2048, 32768, 64),
    ("v32-b3-sq2-h128", 3, 2, 128, 2048, 32768, 64),  # 12 rows: 11 splits, or 8 in clusters of 8
    ("b28-sq1-h64", 28, 1, 64, 2048, 32768, 64),  # 28 rows: 4 splits, in clusters of 4 if they fit
    ("v32-b16-sq1-h128", 16, 1, 128, 2048, 32768, 64),  # 32 rows: 4 splits, the combine kernel
    ("b24-sq1-h64", 24, 1, 64, 2048, 32768, 64),  # 24 rows: 5 splits, the combine kernel
    ("b2-sq1-h64", 2, 1, 64, 2048, 32768, 64),  # 2 rows: 16 splits, clusters of 16 (of 32-head CTAs)
    ("b1-sq2-h64", 1, 2, 64, 2048, 32768, 64),  # likewise, an MTP pair
    # the narrow kernel's small batches: 16 splits, one cluster of 16 per token where they fit
    ("b2-sq1-h16", 2, 1, 16, 2048, 32768, 64),
    ("b4-sq1-h16", 4, 1, 16, 2048, 32768, 64),
    ("b1-sq2-h32", 1, 2, 32, 2048, 32768, 64),
    ("b4-sq1-h32", 4, 1, 32, 2048, 32768, 64),
    ("b1-sq1-h8", 1, 1, 8, 2048, 32768, 64),  # 16 splits over 8 heads: each CTA merges half a head
    # mid batches: split plans whose own clusters do not fit (the combine kernel, or with
    # MLA_KERNELS_DECODE_RESPLIT=fit fewer splits in clusters that do)
    ("b8-sq1-h8", 8, 1, 8, 2048, 32768, 64),
    ("b8-sq1-h16", 8, 1, 16, 2048, 32768, 64),
    ("b16-sq1-h16", 16, 1, 16, 2048, 32768, 64),
    ("b32-sq1-h16", 32, 1, 16, 2048, 32768, 64),
    ("b16-sq1-h32", 16, 1, 32, 2048, 32768, 64),
    ("b32-sq1-h32", 32, 1, 32, 2048, 32768, 64),
    ("b16-sq1-h64", 16, 1, 64, 2048, 32768, 64),
    ("b32-sq1-h64", 32, 1, 64, 2048, 32768, 64),
    ("b36-sq1-h16", 36, 1, 16, 2048, 32768, 64),  # 3 splits: clusters of 3 (6 / 5 / 5 heads)
    ("b36-sq1-h64", 36, 1, 64, 2048, 32768, 64),  # 3 splits: clusters of 3 (39 fit; 22 / 22 / 20 heads)
    ("v32-b18-sq1-h128", 18, 1, 128, 2048, 32768, 64),  # 36 rows of 64 heads: likewise
    ("b20-sq1-h64", 20, 1, 64, 2048, 32768, 64),  # 6 splits' clusters do not fit: 4 (5 would hold 7 blocks)
    ("v32-b8-sq1-h128", 8, 1, 128, 2048, 32768, 64),
    ("v32-b4-sq2-h128", 4, 2, 128, 2048, 32768, 64),
]
QUICK = [
    ("quick-b2-h16", 2, 1, 16, 128, 1024, 16),
    ("quick-b1-h64", 1, 2, 64, 256, 1024, 16),
]
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}


def flops(b, s_q, h_q, topk, d_qk=D_QK, d_v=D_V):
    return 2.0 * b * s_q * h_q * topk * (d_qk + d_v)


def gathered_bytes(b, s_q, topk, d_qk=D_QK):
    return float(b * s_q * topk * d_qk * 2)


def hbm_of(gpu_name: str):
    for k, v in HBM_BYTES_PER_S.items():
        if k in gpu_name:
            return v
    return None


PEER_DIRS = (".peers", ".pdec")  # the full peers tree, or the decode binary alone


def flashmla_binary(peers=None):
    """FlashMLA's decode anchor binary: ``$MLA_FLASHMLA_DECODE_BIN``, else
    ``<peers>/anchors/flashmla/bench_sm90_decode`` for ``--peers DIR``, else that path under a
    ``.peers`` or ``.pdec`` directory above this file."""
    env = os.environ.get("MLA_FLASHMLA_DECODE_BIN")
    if env:
        return env if os.path.isfile(env) else None
    rel = os.path.join("anchors", "flashmla", "bench_sm90_decode")
    if peers:
        cand = os.path.join(peers, rel)
        return cand if os.path.isfile(cand) else None
    d = os.path.dirname(os.path.abspath(__file__))
    for _ in range(5):
        for sub in PEER_DIRS:
            cand = os.path.join(d, sub, rel)
            if os.path.isfile(cand):
                return cand
        d = os.path.dirname(d)
    return None


def run_flashmla(binary, cases):
    """``{(b, s_q, h_q, topk, s_kv): (kernel+combine ms, TFLOPS)}`` from one run of the anchor."""
    args = [f"{b}:{s_q}:{h}:{topk}:{s_kv}" for (b, s_q, h, topk, s_kv) in cases]
    res = {}
    if not args:
        return res
    try:
        p = subprocess.run([binary] + args, capture_output=True, text=True, timeout=300)
    except Exception as e:  # pragma: no cover - depends on the machine
        print(f"FlashMLA anchor failed: {e}")
        return res
    for line in p.stdout.splitlines():
        if line.startswith("#") or not line.strip():
            if line.startswith("#"):
                print(f"  flashmla: {line}")
            continue
        parts = line.split()
        try:
            key = tuple(int(x) for x in parts[:5])
            res[key] = (float(parts[7]), float(parts[8]))
        except (ValueError, IndexError):
            print(f"  flashmla: {line}")
    if p.returncode:
        print(f"  flashmla exited {p.returncode}: {p.stderr.strip()[-300:]}")
    return res


def make_cache(n_seqs, seq_len, page_size, device, dtype, seed=0):
    """A paged cache holding ``n_seqs`` sequences of ``seq_len`` tokens in shuffled pages."""
    g = torch.Generator(device=device).manual_seed(seed)
    pps = -(-seq_len // page_size)
    kv = torch.randn(n_seqs * pps, page_size, 1, D_QK, device=device, dtype=dtype, generator=g)
    perm = torch.randperm(n_seqs * pps, device=device, generator=g)
    return kv, perm.reshape(n_seqs, pps).to(torch.int32)


def make_sets(n_sets, b, s_q, h_q, topk, seq_len, device, dtype, seed=1):
    """Input sets: q and distinct random logical positions per query (as a top-k gives)."""
    g = torch.Generator(device=device).manual_seed(seed)
    sets = []
    for _ in range(n_sets):
        q = torch.randn(b, s_q, h_q, D_QK, device=device, dtype=dtype, generator=g)
        pos = torch.rand(b * s_q, seq_len, device=device, generator=g).topk(topk, dim=1).indices
        sets.append((q, pos.reshape(b, s_q, topk).to(torch.int32).contiguous()))
    return sets


def time_gpu(fn, n_sets, warmup, reps):
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
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times), times


def time_cpu(fn, n_sets, warmup, reps):
    for i in range(warmup):
        fn(i % n_sets)
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i % n_sets)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times), times


def capture_graphs(call, n_sets):
    """One CUDA graph of ``call(i)`` per input set (a warm-up call on a side stream first)."""
    graphs = []
    for i in range(n_sets):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call(i)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            call(i)
        graphs.append(g)
    return graphs


B2B = 10  # graph steps back to back per sample in ``time_graph``'s second number


def time_graph(call, n_sets, warmup, reps, b2b=B2B):
    """GPU time of one decode step replayed from a CUDA graph (one graph per input set): the
    kernels are submitted at once, so no host launch latency sits between them -- unlike the
    eager timing, where at small batches the GPU waits for the host to launch the combine.

    Returns ``(synced, b2b)``: the median of one replay per event pair after a sync (the host's
    ``cudaGraphLaunch`` -- a few us -- then sits inside the time: the GPU records the start event
    and waits for the graph), and the median per-step time of ``b2b`` replays back to back per event
    pair (input sets rotating; the host runs ahead of the GPU, as FlashMLA's binary's back-to-back
    launches do, and as the layers of a graph-captured model step follow each other)."""
    graphs = capture_graphs(call, n_sets)
    med, _ = time_gpu(lambda i: graphs[i].replay(), n_sets, warmup, reps)

    def burst(i):
        for k in range(b2b):
            graphs[(i + k) % n_sets].replay()

    med_b2b, _ = time_gpu(burst, n_sets, warmup, reps)
    return med, med_b2b / b2b


def host_time_us(fn, n=200):
    """Median wall time of the Python call (launches are asynchronous: no sync in the loop)."""
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(0)
        times.append((time.perf_counter() - t0) * 1e6)
        if i % 50 == 49 and torch.cuda.is_available():
            torch.cuda.synchronize()
    return statistics.median(times)


def _prefill_fwd_fn(sets, kv, bt, page_size, b, s_q, h_q, topk, sm_scale):
    """The prefill forward kernel on the flattened tokens (physical ids), bypassing the API's
    small-s_q routing -- the pre-decode-path baseline."""
    from mla_kernels import dispatch
    from mla_kernels.common.problem import Problem

    backend = dispatch.get_backend("sm90")
    kv2 = kv.reshape(-1, D_QK)
    probs = []
    for q, pos in sets:
        phys = (bt[:b].long().gather(1, (pos.long() // page_size).reshape(b, -1)).reshape(pos.shape) * page_size
                + pos.long() % page_size).to(torch.int32)
        probs.append(Problem(q.reshape(b * s_q, h_q, D_QK), kv2, phys.reshape(b * s_q, topk), sm_scale, D_V, None,
                             None, kv2.shape))
    return lambda i: backend.fwd(probs[i])


def rows(args):
    """The benchmark rows (list of dicts); prints a table as it goes."""
    reps = max(20, getattr(args, "reps", 30))
    warmup = getattr(args, "warmup", 5)
    n_sets = getattr(args, "sets", 3)
    cpu = getattr(args, "cpu", False) or not torch.cuda.is_available()
    quick = getattr(args, "quick", False) or cpu
    only = getattr(args, "cases", "") or ""
    forced_splits = getattr(args, "num_splits", None)
    physical = getattr(args, "physical", False)
    from mla_kernels.common.decode_host import combine_mode, decode_knobs

    knobs = dict(zip(("pdl", "l2_prefetch"), decode_knobs()), combine=combine_mode(),
                 l2_policy=os.environ.get("MLA_KERNELS_DECODE_L2_POLICY", "auto"))
    device = torch.device("cpu" if cpu else "cuda")
    dtype = torch.float32 if cpu else torch.bfloat16
    if cpu:
        print("NOTE: no CUDA GPU here -- tiny decode shapes on the CPU PyTorch reference only.")
        gpu = "cpu"
    else:
        gpu = torch.cuda.get_device_name(device)
        print(f"GPU: {gpu}; decode backend: {mk.backend_for(device)}")
    hbm = hbm_of(gpu)
    cases = QUICK if quick else CASES
    if only:
        keep = set(only.split(","))
        cases = [c for c in (QUICK if quick else CASES + EXTRA) if c[0] in keep]
    if not cases:
        return []
    timer = time_cpu if cpu else time_gpu
    max_b = max(c[1] for c in cases)
    seq_len, page_size = cases[0][5], cases[0][6]
    kv, bt_all = make_cache(max_b, seq_len, page_size, device, dtype)
    sm_scale = D_QK ** -0.5
    out_rows = []
    t_by_shape = {}
    for name, b, s_q, h_q, topk, _, _ in cases:
        sets = make_sets(n_sets, b, s_q, h_q, topk, seq_len, device, dtype)
        bt = bt_all[:b].contiguous()
        plan = mk.decode_plan(b, s_q, h_q, topk, device=device, dtype=dtype, num_splits=forced_splits)
        if physical:  # FlashMLA's convention: physical ids, no block table in the kernel
            sets = [(q, (bt.long().gather(1, (pos.long() // page_size).reshape(b, -1)).reshape(pos.shape) * page_size
                         + pos.long() % page_size).to(torch.int32)) for q, pos in sets]
            bt = None

        def call(i, plan=plan, sets=sets, bt=bt, kv=kv):
            q, pos = sets[i]
            return mk.sparse_mla_decode(q, kv, pos, sm_scale, D_V, block_table=bt, plan=plan)

        def call_backend(i, plan=plan, sets=sets, bt=bt, kv=kv):  # the launches alone (no API checks)
            q, pos = sets[i]
            return plan.backend.decode(plan, q, kv, pos, sm_scale, None, None, bt, None)

        med, times = timer(call, n_sets, warmup, reps)
        host = host_time_us(call) if not cpu else None
        host_be = host_time_us(call_backend) if not cpu else None
        graph_us = graph_b2b_us = None
        if not cpu and not getattr(args, "no_graph", False):
            try:
                graph_us, graph_b2b_us = time_graph(call, n_sets, warmup, reps)
            except Exception as e:  # report, keep going
                print(f"  {name}: graph capture failed: {type(e).__name__}: {e}")
        row = dict(shape=name, op="decode", backend=plan.backend_name, gpu=gpu, b=b, s_q=s_q, h_q=h_q, topk=topk,
                   d_qk=D_QK, d_v=D_V, seq_len=seq_len, page_size=page_size, num_splits=plan.num_splits,
                   us=med, ms=med / 1e3, min_us=min(times), max_us=max(times), reps=reps,
                   tflops=flops(b, s_q, h_q, topk) / (med * 1e-6) / 1e12,
                   gbps=gathered_bytes(b, s_q, topk) / (med * 1e-6) / 1e9, host_us=host, host_launch_us=host_be,
                   block_table=not physical, knobs=knobs, graph_us=graph_us, graph_b2b_us=graph_b2b_us,
                   cluster=plan.state.get("cluster", 0))
        if hbm:
            row["hbm_pct"] = 100.0 * gathered_bytes(b, s_q, topk) / (med * 1e-6) / hbm
        if not cpu and h_q % 64 == 0 and not getattr(args, "no_fwd", False):
            try:
                fwd_med, _ = timer(_prefill_fwd_fn(sets, kv, bt_all, page_size, b, s_q, h_q, topk, sm_scale),
                                   n_sets, warmup, reps)
                row["fwd_us"] = fwd_med
            except Exception as e:  # report, keep going
                print(f"  {name}: prefill forward failed: {type(e).__name__}: {e}")
        if forced_splits or physical:
            row["shape"] = name + (f"-n{plan.num_splits}" if forced_splits else "") + ("-phys" if physical else "")
        t_by_shape[(b, s_q, h_q)] = med
        out_rows.append(row)
        hbm_txt = f"  {row['hbm_pct']:5.1f}% HBM" if hbm else ""
        host_txt = f"  host {host:5.1f} us" if host is not None else ""
        if graph_us is not None:
            host_txt += f"  graph {graph_us:7.1f} us  graph b2b {graph_b2b_us:7.1f} us"
        fwd_txt = f"  prefill fwd {row['fwd_us']:8.1f} us" if "fwd_us" in row else ""
        print(f"  {row['shape']:<20} {med:9.1f} us  {row['tflops']:7.1f} TFLOPS  {row['gbps']:7.0f} GB/s{hbm_txt}"
              f"  splits {plan.num_splits:3d}{' (cluster)' if row['cluster'] else ''}{host_txt}{fwd_txt}", flush=True)
        del sets, plan
    # the padded path for h_q < 64: the h_q 64 row of the same batch
    for r in out_rows:
        if r["h_q"] < 64 and (r["b"], r["s_q"], 64) in t_by_shape:
            r["padded_us"] = t_by_shape[(r["b"], r["s_q"], 64)]
            r["x_vs_padded"] = r["padded_us"] / r["us"]
    binary = None if cpu or getattr(args, "no_flashmla", False) else flashmla_binary(getattr(args, "peers", None))
    if binary:
        want = [(r["b"], r["s_q"], r["h_q"], r["topk"], r["seq_len"]) for r in out_rows if r["h_q"] in (64, 128)]
        fm = run_flashmla(binary, want)
        for r in out_rows:
            key = (r["b"], r["s_q"], r["h_q"], r["topk"], r["seq_len"])
            if key in fm:
                r["flashmla_us"], r["flashmla_tflops"] = fm[key][0] * 1e3, fm[key][1]
    elif not cpu:
        print("  (FlashMLA anchor binary not found: set MLA_FLASHMLA_DECODE_BIN)")
    del kv
    return out_rows


def print_table(rs):
    hdr = (f"{'shape':<24} {'us':>8} {'graph':>7} {'b2b':>7} {'TFLOPS':>7} {'GB/s':>6} {'%HBM':>5} {'splits':>6} "
           f"{'host us':>7} {'launch':>6} {'fwd us':>8} {'padded':>7} {'FlashMLA us':>11}")
    print(hdr + "   (splits: 'c' = merged in a cluster over DSMEM)")
    print("-" * len(hdr))
    f = lambda v, w, p=1: f"{v:>{w}.{p}f}" if isinstance(v, (int, float)) else f"{'--':>{w}}"
    for r in rs:
        print(f"{r['shape']:<24} {f(r['us'], 8)} {f(r.get('graph_us'), 7)} {f(r.get('graph_b2b_us'), 7)} {f(r['tflops'], 7)} {f(r['gbps'], 6, 0)} {f(r.get('hbm_pct'), 5)} "
              f"{str(r['num_splits']) + ('c' if r.get('cluster') else ''):>6} {f(r.get('host_us'), 7)} {f(r.get('host_launch_us'), 6)} {f(r.get('fwd_us'), 8)} "
              f"{f(r.get('x_vs_padded'), 7, 2)} {f(r.get('flashmla_us'), 11)}")


SMALL = "v32-b1-sq1-h128,v32-b2-sq2-h128,b1-sq1-h64,b1-sq1-h32,b1-sq1-h16"
AB_VARIANTS = [
    # (label, env, cases, options)
    ("separate", {"MLA_KERNELS_DECODE_COMBINE": "separate"}, SMALL, {}),
    ("cluster", {"MLA_KERNELS_DECODE_COMBINE": "cluster"}, SMALL, {}),
    ("cluster-bf16", {"MLA_KERNELS_DECODE_COMBINE": "cluster", "MLA_KERNELS_DECODE_CLUSTER_PARTS": "bf16"}, SMALL, {}),
    ("cluster-splits-8", {"MLA_KERNELS_DECODE_COMBINE": "cluster"}, "v32-b1-sq1-h128,v32-b2-sq2-h128,b1-sq1-h64",
     {"num_splits": 8}),
    ("cluster-l2", {"MLA_KERNELS_DECODE_COMBINE": "cluster", "MLA_KERNELS_DECODE_CLUSTER_PARTS": "l2"}, SMALL, {}),
    ("fused", {"MLA_KERNELS_DECODE_COMBINE": "fused"}, SMALL, {}),
    ("fused-splits-4", {"MLA_KERNELS_DECODE_COMBINE": "fused"}, "v32-b1-sq1-h128,b1-sq1-h16", {"num_splits": 4}),
    ("fused-splits-8", {"MLA_KERNELS_DECODE_COMBINE": "fused"}, "v32-b1-sq1-h128,b1-sq1-h16", {"num_splits": 8}),
    ("pdl-on", {"MLA_KERNELS_DECODE_PDL": "1"}, SMALL, {}),
    ("l2-256", {"MLA_KERNELS_DECODE_L2_PREFETCH": "256"}, "b128-sq1-h16,b128-sq1-h64", {}),
    ("l2-0", {"MLA_KERNELS_DECODE_L2_PREFETCH": "0"}, "b128-sq1-h16,b128-sq1-h32,b128-sq1-h64", {}),
    ("evict-last", {"MLA_KERNELS_DECODE_L2_POLICY": "last"}, "b128-sq1-h16,b128-sq1-h32", {}),
    ("evict-first", {"MLA_KERNELS_DECODE_L2_POLICY": "first"}, "b128-sq1-h64,v32-b128-sq2-h128", {}),
    ("physical", {}, "v32-b1-sq1-h128,b128-sq1-h16", {"physical": True}),
    ("splits-4", {}, "v32-b1-sq1-h128,b1-sq1-h16", {"num_splits": 4}),
    ("splits-8", {}, "v32-b1-sq1-h128,b1-sq1-h16", {"num_splits": 8}),
    ("splits-32", {}, "v32-b1-sq1-h128,b1-sq1-h16", {"num_splits": 32}),
]


def ab_rows(args):
    """The main rows again under each of :data:`AB_VARIANTS` (a knob, physical ids or a forced
    split count), in this process; rows tagged with ``variant``."""
    out = []
    only = set(args.variants.split(",")) if getattr(args, "variants", "") else None
    for label, env, cases, opts in AB_VARIANTS:
        if only is not None and label not in only:
            continue
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            ns = argparse.Namespace(**{**vars(args), "cases": cases, "no_fwd": True, "no_flashmla": True,
                                       "num_splits": None, "physical": False, **opts})
            print(f"-- variant {label}")
            for r in rows(ns):
                r["variant"] = label
                r["shape"] = f"{r['shape']} [{label}]" if not opts else r["shape"]
                out.append(r)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (the CPU default)")
    ap.add_argument("--cpu", action="store_true", help="force the CPU even if a GPU is present")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--sets", type=int, default=3)
    ap.add_argument("--no-flashmla", action="store_true", help="do not run FlashMLA's anchor binary")
    ap.add_argument("--num-splits", type=int, default=None, help="force the plans' split count")
    ap.add_argument("--physical", action="store_true", help="physical ids instead of the block table")
    ap.add_argument("--no-graph", action="store_true", help="do not time CUDA-graph replays")
    ap.add_argument("--no-fwd", action="store_true", help="do not time the prefill forward on the same tokens")
    ap.add_argument("--ab", action="store_true",
                    help="then the comparisons behind docs/PERF.md's notes: the PDL and L2-prefetch knobs, "
                         "physical ids, forced split counts")
    ap.add_argument("--variants", default="", help="with --ab: only these variant labels (comma-separated)")
    ap.add_argument("--peers", default=None,
                    help="directory holding anchors/flashmla/bench_sm90_decode (default: a .peers or .pdec "
                         "directory above this file)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if args.reps < 20:
        ap.error("--reps must be >= 20 (median of many runs)")
    rs = rows(args)
    if args.ab and torch.cuda.is_available() and not args.cpu:
        rs += ab_rows(args)
    print()
    print_table(rs)
    if args.json:
        meta = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__, reps=args.reps, warmup=args.warmup,
                    sets=args.sets, argv=sys.argv[1:] if argv is None else list(argv))
        with open(args.json, "w") as fh:
            json.dump(dict(meta=meta, rows=rs), fh, indent=1)
        print(f"wrote {args.json}")
    return rs


if __name__ == "__main__":
    main()
