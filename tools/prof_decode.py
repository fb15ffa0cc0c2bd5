#!/usr/bin/env python3
"""Nsight Compute of decode steps: one planned call per case inside ``cudaProfilerStart/Stop``,
and a reader that splits a report's warp-stall samples by warp role.

Profile (GPU; inputs are ``tools/bench_decode.py``'s: a paged cache of 32k-token sequences, page
64, the block table, random distinct positions):

  ncu --clock-control none --set full --import-source yes --profile-from-start off \\
      -k regex:SparseMlaDecode -c 2 -o OUT/decode \\
      python tools/prof_decode.py --cases v32-b128-sq2-h128,b128-sq1-h64

Each case is planned, warmed up (``--warmup`` calls, synchronised), then ONE call runs between
``torch.cuda.profiler.start()`` / ``stop()``.  With ``--time`` (run it outside ncu) it first prints
each case's eager median and CUDA-graph back-to-back median (``bench_decode``'s methods), the
context for the single profiled launch.

Export on the GPU machine (no ncu here):

  ncu --import OUT/decode.ncu-rep --page details > details.txt
  ncu --import OUT/decode.ncu-rep --page source --csv --print-source sass > src.csv
  python tools/prof_decode.py --dump-report OUT/decode.ncu-rep --out-dir DIR  # per-PC samples
      (Nsight Compute's ``ncu_report`` module: ``$NCU_PYTHON`` or found under /opt/nvidia, /usr/local/cuda*)

Read (anywhere): ``python tools/prof_decode.py --read pcs_0.csv [pcs_1.csv ...]`` -- per kernel the
stall samples by reason for each warp role of the warp-specialised decode kernel, located in the
SASS: the code before ``USETMAXREG.DEALLOC`` is the common setup, from it to the producer branch's
``EXIT`` the producer warpgroup (index loads, ``wait_free`` mbarrier waits, ``LDGSTS`` copies),
from ``USETMAXREG.TRY_ALLOC`` on the consumer warpgroups; within a role each instruction is put in
a class (mbarrier wait, named barrier, HGMMA / its wait, copy issue, global load, other) and the
top lines are listed.
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import re
import sys
from collections import Counter, defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

DEFAULT_CASES = "v32-b128-sq2-h128,b128-sq1-h64"


# ---------------------------------------------------------------------------------------------
# Profiling
# ---------------------------------------------------------------------------------------------
def profile(args) -> None:
    import torch

    import bench_decode as bd
    import mla_kernels as mk

    device = torch.device("cuda")
    by_name = {c[0]: c for c in bd.CASES + bd.EXTRA}
    cases = [by_name[n] for n in args.cases.split(",")]
    max_b = max(c[1] for c in cases)
    kv, bt_all = bd.make_cache(max_b, cases[0][5], cases[0][6], device, torch.bfloat16)
    sm_scale = bd.D_QK ** -0.5
    print(f"GPU: {torch.cuda.get_device_name(device)}")
    for name, b, s_q, h_q, topk, seq_len, _ in cases:
        sets = bd.make_sets(args.sets, b, s_q, h_q, topk, seq_len, device, torch.bfloat16)
        bt = bt_all[:b].contiguous()
        plan = mk.decode_plan(b, s_q, h_q, topk, device=device, dtype=torch.bfloat16)

        def call(i, plan=plan, sets=sets, bt=bt):
            q, pos = sets[i]
            return mk.sparse_mla_decode(q, kv, pos, sm_scale, bd.D_V, block_table=bt, plan=plan)

        for i in range(args.warmup):
            call(i % args.sets)
        torch.cuda.synchronize()
        fl = bd.flops(b, s_q, h_q, topk)
        gb = bd.gathered_bytes(b, s_q, topk)
        if args.time:
            med, _ = bd.time_gpu(call, args.sets, 3, args.reps)
            _, b2b = bd.time_graph(call, args.sets, 3, args.reps)
            print(f"  {name}: splits {plan.num_splits}; eager {med:.1f} us ({fl / med / 1e6:.1f} TFLOPS), "
                  f"graph b2b {b2b:.1f} us ({fl / b2b / 1e6:.1f} TFLOPS, {gb / b2b / 1e3:.0f} GB/s gathered)")
        torch.cuda.profiler.start()
        call(0)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"  {name}: one call profiled (splits {plan.num_splits}; {fl / 1e12:.3f} TFLOP, {gb / 1e6:.1f} MB "
              f"gathered)", flush=True)
        del sets, plan


# ---------------------------------------------------------------------------------------------
# Export with Nsight Compute's Python module (on the machine that has ncu)
# ---------------------------------------------------------------------------------------------
def _import_ncu_report():
    cands = [os.environ.get("NCU_PYTHON", "")]
    for pat in ("/opt/nvidia/nsight-compute/*/extras/python", "/usr/local/cuda*/nsight-compute*/extras/python",
                "/usr/local/cuda*/extras/python"):
        cands += sorted(glob.glob(pat), reverse=True)
    import shutil

    ncu = shutil.which("ncu")
    if ncu:
        real = os.path.dirname(os.path.realpath(ncu))
        cands += [os.path.join(real, "extras", "python"), os.path.join(real, "..", "extras", "python")]
        cands += sorted(glob.glob(os.path.join(real, "..", "nsight-compute*", "extras", "python")), reverse=True)
    for c in cands:
        if c and os.path.isfile(os.path.join(c, "ncu_report.py")):
            sys.path.insert(0, c)
            import ncu_report

            return ncu_report
    raise SystemExit(f"ncu_report not found (set NCU_PYTHON); looked in {[c for c in cands if c]}")


def dump_report(path: str, out_dir: str) -> None:
    """Per profiled kernel ``pcs_<k>.csv``: pc, SASS, executed instructions and every per-PC
    ``smsp__pcsamp_*`` sample count (the source page's numbers, from the report itself)."""
    ncu_report = _import_ncu_report()
    ctx = ncu_report.load_report(path)
    os.makedirs(out_dir, exist_ok=True)
    k = 0
    for r in range(ctx.num_ranges()):
        rng = ctx.range_by_idx(r)
        for a in range(rng.num_actions()):
            act = rng.action_by_idx(a)
            per_pc = defaultdict(dict)
            cols = []
            for n in sorted(act.metric_names()):
                if not (n.startswith("smsp__pcsamp_") or n in ("inst_executed", "sass__inst_executed")):
                    continue
                m = act.metric_by_name(n)
                ids = m.correlation_ids() if m is not None else None
                if ids is None:
                    continue
                cols.append(n)
                for i in range(m.num_instances()):
                    per_pc[ids.as_uint64(i)][n] = m.as_uint64(i)
            fn = os.path.join(out_dir, f"pcs_{k}.csv")
            with open(fn, "w", newline="") as fh:
                w = csv.writer(fh)
                w.writerow(["kernel", act.name()])
                w.writerow(["Address", "Source"] + cols)
                for pc in sorted(per_pc):
                    w.writerow([hex(pc), act.sass_by_pc(pc)] + [per_pc[pc].get(c, 0) for c in cols])
            print(f"wrote {fn}: {act.name()[:80]}... {len(per_pc)} PCs, {len(cols)} metrics")
            k += 1


# ---------------------------------------------------------------------------------------------
# Reading: stall samples by warp role
# ---------------------------------------------------------------------------------------------
# the per-PC sample metrics of ``dump_report`` and the source page's column names, both to one name
_REASON = re.compile(r"^(?:smsp__pcsamp_warps_issue_stalled_|stall_)(.+?)(?:_not_issued)?$")
_TOTAL_COLS = ("smsp__pcsamp_sample_count", "# Samples", "Warp Stall Sampling (All Samples)")


def read_rows(path: str):
    """(kernel name, rows) of a ``pcs_<k>.csv`` or a source-page CSV (one kernel): each row
    ``dict(pc, sass, total, reasons={reason: samples}, executed)``; not-issued variants dropped."""
    with open(path, newline="") as fh:
        lines = list(csv.reader(fh))
    kernel = ""
    if lines and lines[0] and lines[0][0] == "kernel":
        kernel = lines[0][1]
        lines = lines[1:]
    head_i = next(i for i, ln in enumerate(lines) if any(c.strip() in ("Address", "# Address") for c in ln))
    head = [c.strip() for c in lines[head_i]]
    ai = head.index("Address") if "Address" in head else head.index("# Address")
    si = head.index("Source")
    rows = []
    for ln in lines[head_i + 1:]:
        if len(ln) < len(head):
            continue
        try:
            pc = int(ln[ai], 16)
        except ValueError:
            continue
        reasons, total, executed = Counter(), None, 0
        for c, v in zip(head, ln):
            try:
                x = float(v.replace(",", "")) if v.strip() else 0.0
            except ValueError:
                continue
            if c in _TOTAL_COLS:
                total = x if total is None else total
            elif c in ("inst_executed", "sass__inst_executed", "Instructions Executed"):
                executed = x
            elif "not_issued" in c or "Not-issued" in c:
                continue
            else:
                m = _REASON.match(c)
                if m and m.group(1) not in ("sample_count",):
                    reasons[m.group(1)] += x
        rows.append(dict(pc=pc, sass=ln[si].strip(), total=total if total is not None else sum(reasons.values()),
                         reasons=reasons, executed=executed))
    return kernel, rows


def instr_class(sass: str) -> str:
    s = sass
    if "SYNCS.PHASECHK" in s or "NANOSLEEP" in s:
        return "mbarrier wait"
    if re.search(r"\bBAR\.(SYNC|RED)", s):
        return "named barrier"
    if "WARPGROUP.DEPBAR" in s:
        return "HGMMA wait"
    if "HGMMA" in s or "WARPGROUP.ARRIVE" in s:
        return "HGMMA issue"
    if "LDGSTS" in s or "ARRIVES.LDGSTSBAR" in s or "LDGDEPBAR" in s:
        return "copy issue"
    if re.search(r"\bLDG\b|\bLDG\.", s):
        return "global load"
    if re.search(r"\bST[GS]\b|\bST[GS]\.", s) or "STSM" in s:
        return "store"
    if re.search(r"\bLDS\b|\bLDS\.|LDSM", s):
        return "smem load"
    if "BRA" in s:
        return "branch"
    return "other"


def roles(rows):
    """Role per row by the producer / consumer register-reallocation markers and the producer's
    EXIT; rows of neither: ``setup`` (before the split) / ``tail``."""
    dealloc = next((r["pc"] for r in rows if "USETMAXREG.DEALLOC" in r["sass"]), None)
    alloc = next((r["pc"] for r in rows if "USETMAXREG.TRY_ALLOC" in r["sass"]), None)
    out = []
    for r in rows:
        if dealloc is None or alloc is None:
            role = "all"
        elif r["pc"] < min(dealloc, alloc):
            role = "setup"
        elif dealloc <= r["pc"] < alloc:
            role = "producer"
        elif r["pc"] >= alloc:
            role = "consumer"
        else:
            role = "tail"
        out.append(role)
    return out


def mbar_target(sass: str) -> str:
    m = re.search(r"\[[^\]]*\+(0x[0-9a-f]+)\]", sass)
    return m.group(1) if m else ""


def wait_sites(rows, rl, role):
    """``(smem offset, pc of the try_wait, samples)`` of each mbarrier wait loop of a role (the
    ``SYNCS.PHASECHK.TRANS64.TRYWAIT`` and the three instructions after it: ``NANOSLEEP.SYNCS``,
    the retry ``PHASECHK``, the branch back; ncu files the samples there under long_scoreboard)."""
    out = []
    for i, r in enumerate(rows):
        if rl[i] == role and "PHASECHK.TRANS64.TRYWAIT" in r["sass"]:
            out.append((mbar_target(r["sass"]), r["pc"], sum(x["total"] for x in rows[i:i + 4])))
    return out


def summarize(path: str, top: int = 25) -> None:
    kernel, rows = read_rows(path)
    rl = roles(rows)
    print(f"== {path}: {kernel[:100]}")
    tot = sum(r["total"] for r in rows)
    print(f"   {len(rows)} SASS lines, {tot:.0f} samples")
    for role in ("setup", "producer", "consumer", "tail", "all"):
        sel = [r for r, x in zip(rows, rl) if x == role]
        if not sel:
            continue
        s = sum(r["total"] for r in sel)
        if s == 0:
            continue
        reasons = Counter()
        classes = Counter()
        for r in sel:
            reasons.update(r["reasons"])
            classes[instr_class(r["sass"])] += r["total"]
        print(f"-- {role}: {s:.0f} samples ({100 * s / max(tot, 1):.1f}%)")
        print("   by reason: " + ", ".join(f"{k} {v:.0f} ({100 * v / s:.1f}%)" for k, v in reasons.most_common(10) if v))
        print("   by instruction class: " + ", ".join(f"{k} {v:.0f} ({100 * v / s:.1f}%)"
                                                      for k, v in classes.most_common() if v))
        waits = wait_sites(rows, rl, role)
        if waits:
            print("   mbarrier wait loops (smem offset: samples, % of role): " + ", ".join(
                f"{off}@{pc:#x} {v:.0f} ({100 * v / s:.1f}%)" for off, pc, v in waits))
        print(f"   top {top} lines:")
        for r in sorted(sel, key=lambda r: -r["total"])[:top]:
            if not r["total"]:
                break
            rs = ", ".join(f"{k} {v:.0f}" for k, v in r["reasons"].most_common(3) if v)
            print(f"     {r['pc']:#07x} {r['total']:7.0f} ({100 * r['total'] / s:4.1f}%) [{instr_class(r['sass'])}] "
                  f"{r['sass'][:70]}  <{rs}>")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=DEFAULT_CASES, help="tools/bench_decode.py case names")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--sets", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--time", action="store_true", help="also time each case (eager, graph b2b) before its profiled call")
    ap.add_argument("--dump-report", metavar="NCU_REP", help="write per-PC sample CSVs of a report (needs ncu_report)")
    ap.add_argument("--out-dir", default=".", help="with --dump-report: where pcs_<k>.csv go")
    ap.add_argument("--read", nargs="+", metavar="CSV", help="summarise per-PC CSVs by warp role")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    if args.read:
        for p in args.read:
            summarize(p, args.top)
        return 0
    if args.dump_report:
        dump_report(args.dump_report, args.out_dir)
        return 0
    if args.reps < 20:
        ap.error("--reps must be >= 20")
    profile(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
