#!/usr/bin/env python3
"""Benchmark of the indexer half of a DSA layer: ``indexer_topk`` (bf16, fp8), ``indexer_loss``
(forward, backward, forward + backward, deterministic backward), with peak extra memory, beside
cuDNN-frontend's sm90 indexer kernels when they are importable.

One causal sequence of S tokens, h_idx 64, d_idx 128, topk 2048 (the issue's shape).  Method as
``tools/bench.py``: CUDA events around one call of the public API (validation included), median
of ``--reps`` runs after ``--warmup``, inputs rotated over ``--sets`` input sets.  Peak memory:
``torch.cuda.max_memory_allocated`` during one call minus what was allocated before it (inputs
excluded, outputs included).

FLOPs (reported as TFLOPS beside ms): scores ``2 h d S (S+1) / 2`` (causal pairs only); one
sparse pass over the selected keys ``2 S topk h d`` (loss forward 1 pass, backward 3).

``rows(args)`` returns the measurements as a list of dicts; ``bench_rows(ctx)`` is the
``tools/bench.py --ops indexer`` family hook (shapes ``S32k``, ``S64k``; ``S128k`` on request);
``python tools/bench_indexer.py`` prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import mla_kernels as mk  # noqa: E402

H, D = 64, 128

#: top-k cases that rerun the default top-k rows under a setting: case -> (variable, [(value, row
#: suffix), ...]); the variable is removed again after each run
ENV_TOPK_CASES = {
    "topk_nohist": ("MLA_KERNELS_INDEXER_TOPK_HIST", [("0", "_nohist")]),
    "sum_parts_topk": ("MLA_KERNELS_INDEXER_SUM_PARTS", [("2", "_chains2"), ("4", "_chains4")]),
    "topk_packed": ("MLA_KERNELS_INDEXER_SCORE_HEADSUM", [("bf16x2", "_bf16x2sum")]),
    "topk_pp": ("MLA_KERNELS_INDEXER_SCORE_PINGPONG", [("1", "_pp")]),
    "topk_nopp": ("MLA_KERNELS_INDEXER_SCORE_PINGPONG", [("0", "_nopp")]),
    "hist_modes": ("MLA_KERNELS_INDEXER_TOPK_HIST", [(m, f"_hist{m}") for m in ("0", "plain", "pad")]),
    "topk_nosmem": ("MLA_KERNELS_INDEXER_TOPK_SMEM", [("0", "_nosmem")]),
    "topk_base": ("MLA_KERNELS_INDEXER_TOPK_VARIANT", [("base", "_vbase")]),
    "topk_1stream": ("MLA_KERNELS_INDEXER_TOPK_STREAMS", [("1", "_1stream")]),
}


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--seqs", default="32768,65536", help="comma-separated sequence lengths S")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--cases", default="topk,topk_fp8,loss,loss_det",
                    help="comma-separated: topk, topk_fp8, topk_nohist (both top-k rows with "
                         "MLA_KERNELS_INDEXER_TOPK_HIST=0, the default: the first histogram by a pass over the row "
                         "instead of fused into the score kernel), hist_modes (both top-k rows with each fused-histogram "
                         "mode: 0, plain, pad), loss, loss_det, loss_shuffled (the loss, default and "
                         "deterministic, with each row's slots in a random order instead of indexer_topk's "
                         "ascending key order), loss_rotate (the loss forward and forward + backward with "
                         "MLA_KERNELS_INDEXER_LOSS_ROTATE=0, rows *_norotate: each query's blocks visited in order "
                         "instead of from block t mod n, the default), "
                         "loss_bulk (dk by bulk reduce), loss_bf16dk (dk by bf16x2 atomics, "
                         "MLA_KERNELS_INDEXER_DK=red_bf16, with dk's error vs the float32 atomics'), "
                         "loss_det_modes (every deterministic dk mode), loss_grouped (deterministic: fixed_bulk64 beside grouped at its default (4 GiB) and with 2 and 1 GiB workspaces), loss_noprefetch (the loss kernels "
                         "with MLA_KERNELS_INDEXER_LOSS_PREFETCH=0), loss_nodk (profiling: the backward "
                         "without dk), topk_parts (score and select kernels timed apart), score_profile "
                         "(the score kernel, bf16 and fp8: full, without its stores, MMAs alone; _hist<mode>: "
                         "counting the fused histogram; _s4: 4 key stages), score_profile_old (weights read from "
                         "smem per key tile, _wsmem; fp8 _kslate: k_scale loaded in the epilogue instead of "
                         "before the MMA; _chainsN: the head sums in N FMA chains instead of 1), "
                         "sum_parts (indexer_topk bf16/fp8 and indexer_loss forward + backward with "
                         "MLA_KERNELS_INDEXER_SUM_PARTS=2 and 4), sum_parts_topk (only the top-k rows of sum_parts), topk_nopp (both top-k rows with "
                         "MLA_KERNELS_INDEXER_SCORE_PINGPONG=0, the default), topk_pp (=1: the score kernel's "
                         "warpgroups take turns issuing their MMAs), topk_packed (MLA_KERNELS_INDEXER_SCORE_HEADSUM="
                         "bf16x2: the head sum in packed bf16, with its logits / top-k differences to the float32 "
                         "head sum); score_profile also times _pp and _bf16x2sum copies; topk_nosmem (both top-k rows "
                         "with MLA_KERNELS_INDEXER_TOPK_SMEM=0: no select variant with rows in shared memory), topk_base "
                         "(both top-k rows with MLA_KERNELS_INDEXER_TOPK_VARIANT=base: the select kernel before its "
                         "variants, every block), topk_1stream (both top-k rows with MLA_KERNELS_INDEXER_TOPK_STREAMS=1: every "
                         "row block on the caller's stream through one workspace, as before the two-stream default), "
                         "loss_fwd_variants (the loss forward and forward + backward with each "
                         "MLA_KERNELS_INDEXER_LOSS_FWD variant, rows *_fwd<variant>, two interleaved rounds))")
    ap.add_argument("--peer-tar", default="",
                    help="cuDNN-frontend tarball (e.g. cudnn-frontend-1.32.0-slim.tar.xz): "
                         "unpacked once into $TMPDIR/mlak_peer and put on sys.path")
    ap.add_argument("--no-peer", action="store_true", help="do not time cuDNN-frontend")
    ap.add_argument("--peer-only", action="store_true", help="time only cuDNN-frontend")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sets", type=int, default=2)


_ON_CUDA = [True]  # where rows() runs (bench.py --cpu may ask for the CPU on a GPU host)


def _time(fn, n_sets, warmup, reps):
    for i in range(warmup):
        fn(i % n_sets)
    if not _ON_CUDA[0]:
        times = []
        for i in range(reps):
            t0 = time.perf_counter()
            fn(i % n_sets)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), times
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


def _peak_mib(fn):
    if not _ON_CUDA[0]:
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn(0)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    del out
    return peak


def _inputs(S, n_sets, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    sets = []
    for _ in range(n_sets):
        q = (torch.randn(S, H, D, device=dev, generator=g) / 4).bfloat16()
        k = (torch.randn(S, D, device=dev, generator=g) / 4).bfloat16()
        w = torch.randn(S, H, device=dev, generator=g) / 8
        sets.append(dict(q=q, k=k, w=w))
    return sets


def _row(rows, case, backend, S, topk, med, times, flop=None, peak=None, note=""):
    r = dict(op="indexer", case=case, backend=backend, S=S, h_idx=H, d_idx=D, topk=topk, ms=med,
             min_ms=min(times), max_ms=max(times), reps=len(times), flop=flop,
             tflops=(flop / (med * 1e-3) / 1e12) if flop else None, peak_mib=peak, note=note)
    rows.append(r)
    tf = f"{r['tflops']:7.1f} TFLOPS" if r["tflops"] else " " * 14
    pk = f"{peak:9.0f} MiB" if peak is not None else ""
    print(f"  S {S:>6} {case:<22} {backend:<7} {med:9.3f} ms {tf} {pk} {note}", flush=True)


def _topk_parts(out, S, TOPK, sets, args, scale, fl_scores):
    """The two kernels of ``indexer_topk`` timed apart over all row blocks: the score kernel into
    the workspace, and the select kernel over a workspace of real scores (every block's, as the
    score kernel wrote them).  Select rows: the default (each block's variant by
    ``indexer_host.topk_variant``), ``_hist<mode>`` (the fused first histogram), ``_v<name>``
    (every block with select variant ``name`` of ``indexer_host.TOPK_VARIANTS``; ``_vbase`` is
    the version before the variants), and per row block (``_blk<i>_<name>``) that block's select
    alone with each variant; a warning if any path chose other keys than the default.  The blocks
    are the one-stream ones (one workspace of ``WORKSPACE_BYTES``), each kernel on the current
    stream."""
    from mla_kernels.api_indexer import make_indexer_problem
    from mla_kernels.common import host
    from mla_kernels.sm90 import indexer_host as ih

    probs = [make_indexer_problem(s["q"], s["k"], s["w"], sm_scale=scale) for s in sets]
    ins = [ih._score_inputs(p) for p in probs]
    rows = ih.block_rows(S, S)
    # every block's scores (and histograms) kept, so that each select reads what its score call
    # wrote (a histogram must describe its row); the input set is fixed (sets rotate otherwise)
    ws = torch.empty(S, S, dtype=torch.float32, device="cuda")
    hist = torch.empty(S, ih.HIST_BINS, dtype=torch.int32, device="cuda")
    idx = torch.empty(S, TOPK, dtype=torch.int32, device="cuda")
    ln = torch.empty(S, dtype=torch.int32, device="cuda")
    dummy = host.dummy(torch.float32, ws.device, (1, 1))
    q2, k, w_eff, ks = ins[0]
    p = probs[0]
    blocks = [(q0, min(rows, S - q0)) for q0 in range(0, S, rows)]
    auto = [ih.topk_variant(ih.block_longest(p, q0, n), TOPK) for q0, n in blocks]
    # (fused histogram mode, per-block variants, row tag): the default first
    configs = [(ih.topk_hist(p), auto, "")]
    if S < 65536:
        configs.append(("pad", ["base"] * len(blocks), "_histpad"))
    configs += [("", [name] * len(blocks), f"_v{name}") for name in ih.TOPK_VARIANTS]
    timed_scores = set()
    picks = {}
    for fused, variants, tag in configs:
        score = ih._score_fn(p, fused)
        hb = hist if fused else ih.no_hist("cuda")
        sel = [ih._topk_fn(p, False, fused, v) for v in variants]

        def f_score(i, score=score, hb=hb, fused=fused):
            for q0, n in blocks:
                score(q2, k, w_eff, ks, p.k_start, p.k_end, ws[q0: q0 + n], hb[q0: q0 + n] if fused else hb, q0, S)

        def f_select(i, sel=sel, hb=hb, fused=fused):
            for (q0, n), select in zip(blocks, sel):
                select(ws[q0: q0 + n], p.k_start, p.k_end, idx, ln, dummy, hb[q0: q0 + n] if fused else hb, q0)

        if fused not in timed_scores:
            timed_scores.add(fused)
            med, ts = _time(f_score, 1, args.warmup, args.reps)
            _row(out, "topk_part_scores" + (f"_hist{fused}" if fused else ""), "ours", S, TOPK, med, ts, fl_scores)
        else:
            f_score(0)  # this config's scores (and histograms) in the workspace
        idx.fill_(-7)
        med, ts = _time(f_select, 1, args.warmup, args.reps)
        _row(out, "topk_part_select" + tag, "ours", S, TOPK, med, ts, None, None,
             f"{S * (S + 1) / 2 * 4 / med / 1e9:.2f} TB/s; variants {','.join(variants)}")
        picks[tag] = (idx.clone(), ln.clone())
    for tag, (a, b) in picks.items():  # every select path chose the same keys
        if not (torch.equal(a, picks[""][0]) and torch.equal(b, picks[""][1])):
            print(f"  WARNING: select{tag} chose different keys than the default select", flush=True)
    # per block: each block's select alone with each variant (the workspace holds the default scores)
    for b, (q0, n) in enumerate(blocks):
        longest = ih.block_longest(p, q0, n)
        for name in ih.TOPK_VARIANTS:
            select = ih._topk_fn(p, False, "", name)

            def f_blk(i, select=select, q0=q0, n=n):
                select(ws[q0: q0 + n], p.k_start, p.k_end, idx, ln, dummy, ih.no_hist("cuda"), q0)

            med, ts = _time(f_blk, 1, args.warmup, args.reps)
            _row(out, f"topk_part_select_blk{b}_{name}", "ours", S, TOPK, med, ts, None, None,
                 f"rows {q0}..{q0 + n - 1}, <= {longest} keys{' (auto)' if name == auto[b] else ''}")
    del ws, hist


def _unpack_peer(tar: str) -> None:
    """Unpack the cuDNN-frontend tarball (once per machine) and put it first on ``sys.path``."""
    import tarfile
    import tempfile

    dst = os.path.join(tempfile.gettempdir(), "mlak_peer")
    if not os.path.isdir(os.path.join(dst, "cudnn")):
        os.makedirs(dst, exist_ok=True)
        with tarfile.open(tar) as tf:
            tf.extractall(dst)
    if dst not in sys.path:
        sys.path.insert(0, dst)


def _cudnn(tar: str = ""):
    try:
        if tar:
            _unpack_peer(tar)
        from cudnn.deepseek_sparse_attention import (  # noqa: F401
            indexer_backward_wrapper, indexer_forward_wrapper, indexer_top_k_wrapper,
            sparse_indexer_score_recompute_wrapper)
        import cudnn.deepseek_sparse_attention as m

        return m
    except Exception as e:  # not installed here
        print(f"  (cuDNN-frontend not importable: {type(e).__name__}: {e}; its rows are skipped)")
        return None


def rows(args):
    """Measure every requested case; returns a list of dicts (one per case x backend x S)."""
    dev = str(getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.startswith("cuda")
    dev = "cuda" if cuda else "cpu"
    _ON_CUDA[0] = cuda
    seqs, TOPK = [int(x) for x in args.seqs.split(",")], args.topk
    if not cuda:
        seqs, TOPK = [128], 16
        print("NOTE: no CUDA GPU here -- a tiny shape (S 128, topk 16) on the CPU PyTorch reference only; "
              "kernel numbers need an sm_90 GPU (see docs/PERF.md)")
    else:
        print(f"GPU: {torch.cuda.get_device_name()}; backend: {mk.backend_for('cuda')}; "
              f"h_idx {H}, d_idx {D}, topk {TOPK}, causal")
    backend = mk.backend_for(dev)
    ours = "ours" if backend != "reference" else "reference"
    cases = args.cases.split(",")
    peer = None if (args.no_peer or not cuda) else _cudnn(getattr(args, "peer_tar", ""))
    mine = [] if getattr(args, "peer_only", False) else cases
    out = []
    scale = D ** -0.5
    for S in seqs:
        fl_scores = 2.0 * H * D * S * (S + 1) / 2
        fl_pass = 2.0 * S * TOPK * H * D
        sets = _inputs(S, args.sets, dev)
        for case, fp8 in (("topk", False), ("topk_fp8", True)):
            if case in mine:
                fn = _topk_fns(sets, _fp8_sets(sets, S, dev) if fp8 else None, TOPK, scale)[fp8]
                med, ts = _time(fn, args.sets, args.warmup, args.reps)
                _row(out, "topk_fp8" if fp8 else "topk_bf16", ours, S, TOPK, med, ts, fl_scores, _peak_mib(fn))
                del fn
        for case, (var, runs) in ENV_TOPK_CASES.items():
            if case in mine and cuda:
                for value, suffix in runs:
                    os.environ[var] = value
                    try:
                        _topk_rows(out, S, TOPK, sets, args, scale, fl_scores, dev, suffix)
                    finally:
                        os.environ.pop(var, None)
                if case == "topk_packed":
                    _packed_error(S, TOPK, sets, scale)
        if "sum_parts" in mine and cuda:
            _sum_parts(out, S, TOPK, sets, args, scale, fl_scores, fl_pass, dev)
        if "topk_parts" in mine and cuda:
            _topk_parts(out, S, TOPK, sets, args, scale, fl_scores)
        if "score_profile" in mine and cuda:
            _score_profile(out, S, TOPK, sets, args, scale, fl_scores)
        if "score_profile_old" in mine and cuda:
            _score_profile(out, S, TOPK, sets, args, scale, fl_scores, old=True)
        loss_cases = ("loss", "loss_det", "loss_bulk", "loss_bf16dk", "loss_det_modes", "loss_nodk", "loss_noprefetch",
                      "loss_shuffled", "loss_rotate", "loss_fwd_variants", "loss_grouped")
        if any(c in mine for c in loss_cases):
            idx, ln = mk.indexer_topk(sets[0]["q"], sets[0]["k"], sets[0]["w"], TOPK, sm_scale=scale)
            g = torch.Generator(device=dev).manual_seed(1)
            tgt = torch.softmax(torch.randn(S, TOPK, device=dev, generator=g), -1) * (idx >= 0)
            idx_sorted, tgt_sorted = idx, tgt
            leaves = [dict(q=s["q"].clone().requires_grad_(True), k=s["k"].clone().requires_grad_(True),
                           w=s["w"].clone().requires_grad_(True)) for s in sets]
            # (deterministic, dk mode): MLA_KERNELS_INDEXER_DK (red, bulk, none) or
            # MLA_KERNELS_INDEXER_DET ("" = the default grouped, or one of the other modes)
            variants = ([(False, "red")] if "loss" in mine else []) + ([(True, "")] if "loss_det" in mine else [])
            variants += [(False, "bulk")] if ("loss_bulk" in mine and cuda) else []
            variants += [(False, "red_bf16")] if ("loss_bf16dk" in mine and cuda) else []
            variants += [(False, "none")] if ("loss_nodk" in mine and cuda) else []
            variants += [(False, "noprefetch"), (True, "noprefetch")] if ("loss_noprefetch" in mine and cuda) else []
            if "loss_det_modes" in mine and cuda:
                variants += [(True, m) for m in ("fixed_bulk", "fixed_bulk2", "fixed_bulk32x2", "fixed_red", "slots")]
            if "loss_grouped" in mine and cuda:  # the grouped mode at its default (4 GiB) and with 2 and 1 GiB workspaces
                variants += [(True, "fixed_bulk64"), (True, "grouped"), (True, "grouped_2g"), (True, "grouped_1g")]
            variants += [(False, "shuffled"), (True, "shuffled")] if "loss_shuffled" in mine else []
            variants += [(False, "rotate")] if ("loss_rotate" in mine and cuda) else []
            for det, dk in variants:
                tag = ("_det" if det else "") + (f"_{'norotate' if dk == 'rotate' else dk}" if dk and dk != "red" else "")
                # "shuffled": each row's valid slots (and their targets) in a random order, the
                # -1 padding kept at the end -- what the default rows get in ascending key order
                idx, tgt = (shuffle_slots(idx_sorted, tgt_sorted, ln, seed=2) if dk == "shuffled"
                            else (idx_sorted, tgt_sorted))
                # the default rows take the default block order (rotated); "rotate" times the
                # unrotated one beside it
                if dk == "rotate":
                    os.environ["MLA_KERNELS_INDEXER_LOSS_ROTATE"] = "0"
                else:
                    os.environ.pop("MLA_KERNELS_INDEXER_LOSS_ROTATE", None)
                if dk in ("shuffled", "rotate"):
                    dk = ""
                os.environ["MLA_KERNELS_INDEXER_DET_WS_MIB"] = {"grouped_2g": "2048", "grouped_1g": "1024"}.get(dk, "")
                if dk in ("grouped_2g", "grouped_1g"):
                    dk = "grouped"  # the tag (_det_grouped_2g / _1g) keeps the workspace apart
                os.environ["MLA_KERNELS_INDEXER_LOSS_PREFETCH"] = "0" if dk == "noprefetch" else "1"
                os.environ["MLA_KERNELS_INDEXER_DET" if det else "MLA_KERNELS_INDEXER_DK"] = (
                    "" if det and dk in ("noprefetch", "") else ("red" if dk in ("noprefetch", "") else dk))

                fwd, fwd_bwd = _loss_calls(leaves, idx, tgt, ln, scale, deterministic=det)
                if not det and dk in ("red", "noprefetch", ""):
                    med, ts = _time(fwd, args.sets, args.warmup, args.reps)
                    _row(out, "loss_fwd" + tag, ours, S, TOPK, med, ts, fl_pass, _peak_mib(fwd))
                med, ts = _time(fwd_bwd, args.sets, args.warmup, args.reps)
                _row(out, "loss_fwd_bwd" + tag, ours, S, TOPK, med, ts, 4 * fl_pass, _peak_mib(fwd_bwd))
            os.environ.pop("MLA_KERNELS_INDEXER_DK", None)
            os.environ.pop("MLA_KERNELS_INDEXER_DET", None)
            os.environ.pop("MLA_KERNELS_INDEXER_DET_WS_MIB", None)
            os.environ.pop("MLA_KERNELS_INDEXER_LOSS_PREFETCH", None)
            os.environ.pop("MLA_KERNELS_INDEXER_LOSS_ROTATE", None)
            if "loss_fwd_variants" in mine and cuda:
                _loss_fwd_variants(out, S, TOPK, leaves, idx_sorted, tgt_sorted, ln, scale, args, fl_pass)
            if "loss_bf16dk" in mine and cuda:
                _dk_error(leaves[0], idx_sorted, tgt_sorted, ln, scale)
            os.environ.pop("MLA_KERNELS_INDEXER_LOSS_PREFETCH", None)
            os.environ.pop("MLA_KERNELS_INDEXER_LOSS_ROTATE", None)
            del leaves
        if peer is not None:
            _peer_rows(out, peer, S, TOPK, sets, cases, args, scale, fl_scores, fl_pass)
        del sets
        if cuda:
            torch.cuda.empty_cache()
    return out


def _loss_fwd_variants(out, S, TOPK, leaves, idx, tgt, ln, scale, args, fl_pass, rounds=2):
    """The loss forward (and forward + backward) with each ``MLA_KERNELS_INDEXER_LOSS_FWD`` variant,
    ``rounds`` interleaved rounds in this process (the A/B of issue 19), and each variant's loss
    rows against the ``smem`` variant's (max relative difference, printed)."""
    from mla_kernels.sm90 import indexer_host as ih

    ref_rows = {}
    for rnd in range(rounds):
        for var in ("smem",) + tuple(v for v in ih.LOSS_FWD_VARIANTS if v != "smem"):
            os.environ[ih.ENV_LOSS_FWD] = var

            fwd = _loss_calls(leaves, idx, tgt, ln, scale, reduction="none")[0]
            fwd_bwd = _loss_calls(leaves, idx, tgt, ln, scale)[1]
            if rnd == 0:
                ref_rows[var] = fwd(0).clone()
            med, ts = _time(fwd, args.sets, args.warmup, args.reps)
            _row(out, f"loss_fwd_fwd{var}", "ours", S, TOPK, med, ts, fl_pass, note=f"round {rnd}")
            med, ts = _time(fwd_bwd, args.sets, args.warmup, args.reps)
            _row(out, f"loss_fwd_bwd_fwd{var}", "ours", S, TOPK, med, ts, 4 * fl_pass, note=f"round {rnd}")
    os.environ.pop(ih.ENV_LOSS_FWD, None)
    base = ref_rows["smem"]
    for var, rows in ref_rows.items():
        d = ((rows - base).abs() / (1 + base.abs())).max().item()
        print(f"  loss rows {var} vs smem: max |diff| / (1 + |row|) {d:.3e}; mean loss {rows.mean().item():.6f}",
              flush=True)


def _packed_error(S, TOPK, sets, scale, n_logit_rows=2048, n_rows=512):
    """The packed bf16x2 head sum (``MLA_KERNELS_INDEXER_SCORE_HEADSUM=bf16x2``) against the float32
    one, bf16 and fp8 inputs: logits of the last ``n_logit_rows`` queries (error over the row's
    largest |logit|: max and median), and the top-k sets of the full problem (fraction of
    ``n_rows`` sampled rows' selected keys that differ)."""
    s = sets[0]
    s8 = dict(q=s["q"].to(torch.float8_e4m3fn), k=s["k"].to(torch.float8_e4m3fn), w=s["w"],
              q_scale=torch.ones(S, H, device="cuda"), k_scale=torch.ones(S, device="cuda"))
    rows = torch.randperm(S, generator=torch.Generator().manual_seed(0))[:n_rows].cuda()
    for tag, x, extra in (("bf16", s, {}), ("fp8", s8, dict(q_scale=s8["q_scale"], k_scale=s8["k_scale"]))):
        lg, tk = {}, {}
        t0 = S - n_logit_rows
        ke = torch.arange(t0 + 1, S + 1, dtype=torch.int32, device="cuda")
        ks = torch.zeros_like(ke)
        ex = dict(extra, q_scale=extra["q_scale"][t0:]) if extra else {}
        for mode in ("f32", "bf16x2"):
            os.environ["MLA_KERNELS_INDEXER_SCORE_HEADSUM"] = mode
            lg[mode] = mk.indexer_logits(x["q"][t0:], x["k"], x["w"][t0:], sm_scale=scale, k_start=ks, k_end=ke, **ex)
            tk[mode] = mk.indexer_topk(x["q"], x["k"], x["w"], TOPK, sm_scale=scale, **extra)[0][rows]
        os.environ.pop("MLA_KERNELS_INDEXER_SCORE_HEADSUM", None)
        a, b = lg["bf16x2"], lg["f32"]
        fin = torch.isfinite(b)
        rmax = torch.where(fin, b.abs(), torch.zeros_like(b)).amax(1, keepdim=True).clamp_min(1e-30)
        rel = torch.where(fin, (a - b).abs() / rmax, torch.zeros_like(b))
        diff = 0
        for i in range(n_rows):
            u, v = tk["f32"][i], tk["bf16x2"][i]
            u, v = u[u >= 0], v[v >= 0]
            diff += u.numel() - torch.isin(u, v).sum().item()
        tot = (tk["f32"] >= 0).sum().item()
        print(f"  head sum bf16x2 vs f32, {tag}: logits |err| / row max|logit|: max {rel.max().item():.3e}, "
              f"median {rel[fin].median().item():.3e}; top-k keys differing: {diff} of {tot} "
              f"({100.0 * diff / max(tot, 1):.2f}%) over {n_rows} rows", flush=True)
    del s8


def _dk_error(s, idx, tgt, ln, scale):
    """dk of the ``red_bf16`` mode (bf16x2 atomics) against the default float32 atomics' on the
    same inputs: relative Frobenius error and the largest error over the largest |dk| (printed)."""
    dks = {}
    for mode in ("red", "red_bf16"):
        os.environ["MLA_KERNELS_INDEXER_DK"] = mode
        k = s["k"].detach().clone().requires_grad_(True)
        mk.indexer_loss(s["q"].detach(), k, s["w"].detach(), idx, tgt, sm_scale=scale, topk_length=ln).backward()
        dks[mode] = k.grad.float()
    os.environ.pop("MLA_KERNELS_INDEXER_DK", None)
    ref, got = dks["red"], dks["red_bf16"]
    fro = ((got - ref).norm() / ref.norm()).item()
    mx = ((got - ref).abs().max() / ref.abs().max()).item()
    print(f"  dk red_bf16 vs red (float32 atomics, then bf16): relative Frobenius error {fro:.3e}, "
          f"max |error| / max |dk| {mx:.3e}", flush=True)


def shuffle_slots(idx, tgt, length, seed=0):
    """``(idx, tgt)`` with each row's first ``length[t]`` slots permuted at random (the same
    permutation for both; the rest of the row kept): the same loss, another visiting order."""
    s_q, topk = idx.shape
    g = torch.Generator(device=idx.device).manual_seed(seed)
    r = torch.rand(s_q, topk, device=idx.device, generator=g)
    pos = torch.arange(topk, device=idx.device)[None, :]
    valid = pos < length[:, None].long()
    r = torch.where(valid, r, 2.0 + pos.float())  # invalid slots sort last, in place
    perm = r.argsort(dim=1)
    return idx.gather(1, perm), tgt.gather(1, perm)


def _fp8_sets(sets, S, dev):
    """The bf16 input sets cast to float8 (e4m3), with unit dequantisation scales."""
    return [dict(q=s["q"].to(torch.float8_e4m3fn), k=s["k"].to(torch.float8_e4m3fn),
                 qs=torch.ones(S, H, device=dev), ks=torch.ones(S, device=dev), w=s["w"]) for s in sets]


def _topk_fns(sets, s8, TOPK, scale):
    """``(bf16 call, fp8 call)``: ``indexer_topk`` on input set ``i``."""
    def f16(i):
        s = sets[i]
        return mk.indexer_topk(s["q"], s["k"], s["w"], TOPK, sm_scale=scale)

    def f8(i):
        s = s8[i]
        return mk.indexer_topk(s["q"], s["k"], s["w"], TOPK, sm_scale=scale, q_scale=s["qs"], k_scale=s["ks"])
    return f16, f8


def _topk_rows(out, S, TOPK, sets, args, scale, fl_scores, dev, tag):
    """``indexer_topk`` bf16 and fp8 rows (as the default cases) under the current environment."""
    f16, f8 = _topk_fns(sets, _fp8_sets(sets, S, dev), TOPK, scale)
    for name, fn in (("topk_bf16", f16), ("topk_fp8", f8)):
        med, ts = _time(fn, args.sets, args.warmup, args.reps)
        _row(out, name + tag, "ours", S, TOPK, med, ts, fl_scores, _peak_mib(fn))


def _loss_calls(leaves, idx, tgt, ln, scale, deterministic=False, reduction="mean"):
    """``(fwd, fwd_bwd)``: one ``indexer_loss`` call on input set ``i`` of ``leaves`` without
    autograd, and one forward + backward (gradients cleared first)."""

    def fwd(i):
        s = leaves[i]
        with torch.no_grad():
            return mk.indexer_loss(s["q"], s["k"], s["w"], idx, tgt, sm_scale=scale, topk_length=ln,
                                   reduction=reduction, deterministic=deterministic)

    def fwd_bwd(i):
        s = leaves[i]
        for x in s.values():
            x.grad = None
        loss = mk.indexer_loss(s["q"], s["k"], s["w"], idx, tgt, sm_scale=scale, topk_length=ln,
                               reduction=reduction, deterministic=deterministic)
        loss.backward()
        return loss

    return fwd, fwd_bwd


def _sum_parts(out, S, TOPK, sets, args, scale, fl_scores, fl_pass, dev):
    """``indexer_topk`` (bf16, fp8) and ``indexer_loss`` forward + backward with the head sums in 2
    or 4 FMA chains (``MLA_KERNELS_INDEXER_SUM_PARTS``; the default rows use 1)."""
    topk_bf16, topk_fp8 = _topk_fns(sets, _fp8_sets(sets, S, dev), TOPK, scale)
    idx, ln = mk.indexer_topk(sets[0]["q"], sets[0]["k"], sets[0]["w"], TOPK, sm_scale=scale)
    g = torch.Generator(device=dev).manual_seed(1)
    tgt = torch.softmax(torch.randn(S, TOPK, device=dev, generator=g), -1) * (idx >= 0)
    leaves = [dict(q=s["q"].clone().requires_grad_(True), k=s["k"].clone().requires_grad_(True),
                   w=s["w"].clone().requires_grad_(True)) for s in sets]

    loss = _loss_calls(leaves, idx, tgt, ln, scale)[1]
    try:
        for parts in ("2", "4"):
            os.environ["MLA_KERNELS_INDEXER_SUM_PARTS"] = parts
            for name, fn, fl in (("topk_bf16", topk_bf16, fl_scores), ("topk_fp8", topk_fp8, fl_scores),
                                 ("loss_fwd_bwd", loss, 4 * fl_pass)):
                med, ts = _time(fn, args.sets, args.warmup, args.reps)
                _row(out, f"{name}_chains{parts}", "ours", S, TOPK, med, ts, fl)
    finally:
        os.environ.pop("MLA_KERNELS_INDEXER_SUM_PARTS", None)


def _score_profile(out, S, TOPK, sets, args, scale, fl_scores, old=False):
    """The score kernel over all row blocks (bf16 and fp8) as built, without its stores, and with
    the MMAs alone (``IndexerScoreSm90(profile=...)`` timing copies): where its time goes."""
    from mla_kernels import _compile
    from mla_kernels.api_indexer import make_indexer_problem
    from mla_kernels.sm90 import indexer_host as ih
    from mla_kernels.sm90.indexer_score import compile_score

    arch = _compile.arch_for_device(torch.device("cuda"))
    rows = ih.block_rows(S, S)
    ws = torch.empty(rows, S, dtype=torch.float32, device="cuda")
    hist = torch.empty(rows, ih.HIST_BINS, dtype=torch.int32, device="cuda")
    for fp8 in (False, True):
        probs = []
        for s in sets:
            if fp8:
                probs.append(make_indexer_problem(s["q"].to(torch.float8_e4m3fn), s["k"].to(torch.float8_e4m3fn),
                                                  s["w"], sm_scale=scale, q_scale=torch.ones(S, H, device="cuda"),
                                                  k_scale=torch.ones(S, device="cuda")))
            else:
                probs.append(make_indexer_problem(s["q"], s["k"], s["w"], sm_scale=scale))
        ins = [ih._score_inputs(p) for p in probs]
        # (profile, w_regs, ks_early, sum_parts, hist mode, stages, pingpong)
        if old:
            variants = [("", False, True, 1, "", 0, False), ("", True, True, 2, "", 0, False),
                        ("", True, True, 4, "", 0, False)]
            variants += [("", True, False, 1, "", 0, False)] if fp8 else []  # k_scale in the epilogue (the old place)
        else:
            variants = [("", True, True, 1, "", 0, False), ("mma", True, True, 1, "", 0, False)]
            # the warpgroups taking turns at the tensor core (ping-pong), full and MMAs alone
            variants += [("", True, True, 1, "", 0, True)]
            # the head sum in packed bf16 (opt-in), alone and with the ping-pong
            variants += [("", True, True, 1, "", 0, False, "bf16x2"), ("", True, True, 1, "", 0, True, "bf16x2")]

        for prof, w_regs, ks_early, parts, hi, stages, pp, *hs in variants:
            hs = hs[0] if hs else "f32"
            _, fn = compile_score(fp8, H, D, arch, profile=prof, w_regs=w_regs, ks_early=ks_early, sum_parts=parts,
                                  hist=hi, stages=stages, pingpong=pp, head_sum=hs)
            hb = hist if hi else ih.no_hist("cuda")

            def f(i, fn=fn, hb=hb):
                q2, k, w_eff, ks = ins[i]
                p = probs[i]
                for q0 in range(0, S, rows):
                    fn(q2, k, w_eff, ks, p.k_start, p.k_end, ws[: min(rows, S - q0)], hb, q0, S)
            med, ts = _time(f, args.sets, args.warmup, args.reps)
            tag = (f"score_{'fp8' if fp8 else 'bf16'}_{prof or 'full'}" + ("" if w_regs else "_wsmem")
                   + ("" if ks_early else "_kslate") + ("" if parts == 1 else f"_chains{parts}")
                   + (f"_hist{hi}" if hi else "") + (f"_s{stages}" if stages else "") + ("_pp" if pp else "")
                   + ("" if hs == "f32" else f"_{hs}sum"))
            _row(out, tag, "ours", S, TOPK, med, ts, fl_scores)
        del probs, ins


def _peer_rows(out, m, S, TOPK, sets, cases, args, scale, fl_scores, fl_pass):
    """cuDNN-frontend 1.32.0's sm90 indexer (its public Python API, timed in this process): dense
    [S, S] f32 scores + radix top-k; predict recompute + indexer backward (the KL in PyTorch)."""
    p_sets = [dict(q=s["q"].view(1, S, H, D), k=s["k"].view(1, S, 1, D), w=s["w"].bfloat16().view(1, S, H))
              for s in sets]
    seq = torch.arange(1, S + 1, dtype=torch.int32, device="cuda")

    def run(case, fn, flop):
        try:
            med, ts = _time(fn, args.sets, args.warmup, args.reps)
            _row(out, case, "cudnn", S, TOPK, med, ts, flop, _peak_mib(fn))
        except Exception as e:  # report, keep going
            print(f"  S {S:>6} {case:<22} cudnn   FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        torch.cuda.empty_cache()

    def topk(i, fp8=False):
        s = p_sets[i]
        if fp8:
            sc = m.indexer_forward_wrapper(s["q8"], s["k8"], s["w"], ratio=1, sm_scale=scale, precision="fp8",
                                           q_scale=s["qs"], k_scale=s["ks"])["scores"]
        else:
            sc = m.indexer_forward_wrapper(s["q"], s["k"], s["w"], ratio=1, sm_scale=scale)["scores"]
        sc = sc.view(S, -1)[:, :S]
        return m.indexer_top_k_wrapper(sc if sc.is_contiguous() else sc.contiguous(), seq, TOPK)

    if "topk" in cases:
        run("topk_bf16", topk, fl_scores)
    if "topk_fp8" in cases:
        for s in p_sets:
            s.update(q8=s["q"].to(torch.float8_e4m3fn), k8=s["k"].to(torch.float8_e4m3fn),
                     qs=torch.ones(1, S, H, device="cuda"), ks=torch.ones(1, S, 1, device="cuda"))
        run("topk_fp8", lambda i: topk(i, True), fl_scores)
        for s in p_sets:
            del s["q8"], s["k8"]
    if "loss" in cases:
        idx, _ = mk.indexer_topk(sets[0]["q"], sets[0]["k"], sets[0]["w"], TOPK, sm_scale=scale)
        idx = idx.view(1, S, TOPK)
        g = torch.Generator(device="cuda").manual_seed(1)
        tgt0 = torch.softmax(torch.randn(1, S, TOPK, device="cuda", generator=g), -1).masked_fill(idx < 0, 0)
        one = torch.ones(1, device="cuda")

        def pred(i):
            s = p_sets[i]
            return m.sparse_indexer_score_recompute_wrapper(s["q"], s["k"][:, :, 0], s["w"], idx)["predict"]

        def fwd_bwd(i):
            s = p_sets[i]
            p = pred(i)
            # the KL in PyTorch (what a cuDNN user writes), then the staged backward
            kl = (tgt0 * (torch.log(tgt0.clamp_min(1e-30)) - torch.log(p.clamp_min(1e-30)))).sum(-1).mean()
            tgt = tgt0.clone()  # the backward overwrites its target
            m.indexer_backward_wrapper(s["q"], s["w"], s["k"][:, :, 0], tgt, p, idx, one, sm_scale=scale)
            return kl

        run("loss_fwd", pred, fl_pass)
        run("loss_fwd_bwd", fwd_bwd, 4 * fl_pass)


# ---------------------------------------------------------------------------------------------
# tools/bench.py family hook
# ---------------------------------------------------------------------------------------------

SHAPES = ("S32k", "S64k", "S128k")
DESCRIPTION = "indexer: indexer_topk (bf16, fp8) and indexer_loss (fwd, fwd+bwd, deterministic) beside cuDNN"


def bench_rows(ctx):
    """``tools/bench.py --ops indexer``: this tool's rows in bench.py's row format (op
    ``indexer_<case>``, shape ``S32k`` ..., impl ``ours`` / ``cudnn`` / ``reference``)."""
    sizes = {"S32k": 32768, "S64k": 65536, "S128k": 131072}
    if ctx.shapes:
        seqs = [sizes[n] for n in SHAPES if n in ctx.shapes]
    else:
        seqs = [32768, 65536]
    if not seqs:
        return []
    args = argparse.Namespace(seqs=",".join(str(x) for x in seqs), topk=2048, device=ctx.device.type,
                              cases="topk,topk_fp8,loss,loss_det", no_peer=False, peer_only=False,
                              reps=ctx.reps, warmup=ctx.warmup, sets=max(1, min(ctx.sets, 2)))
    out = []
    for r in rows(args):
        S = r["S"]
        shape = next((n for n, v in sizes.items() if v == S), f"S{S}")
        out.append(dict(r, op=f"indexer_{r['case']}", shape=shape, impl=r["backend"], flops=r.get("flop")))
        ctx.progress(f"indexer {r['case']} {shape} {r['backend']}: {r['ms']:.3f} ms")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    res = rows(args)
    if args.json:
        meta = dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    torch=torch.__version__, date=time.strftime("%Y-%m-%d"), reps=args.reps, warmup=args.warmup)
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=res), f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
