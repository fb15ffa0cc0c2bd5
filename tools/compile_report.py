#!/usr/bin/env python3
"""Compile every kernel of an arch (no GPU needed) and report what the compiler made of it.

  python tools/compile_report.py --arch sm_90a [--json FILE] [--only NAME,...]

Kernel names say the static configuration: ``<arch>_<op>_d<d_qk>_h<h_q>`` then ``_1cta`` /
``_2cta`` (which sm100 kernel: one CTA per 64 heads, or 2-CTA clusters of 128 heads), ``_topklen``,
``_sink``, ``_asum`` (attn_sum fused in the backward), ``_det`` (deterministic), ``_dlse``,
``_defer`` (the sm90 backward's deferred scatter, ``defer_scatter``), ``_norm`` (normalised attn_dist), ``_heads``/``_tokens`` (the sm90 attn_dist mode), ``_persist`` (its
persistent grid, compiled for 132 SMs), ``_qscalar`` (Q by 4-byte loads instead of the default
16-byte loads and quad shuffles), ``_qring`` (Q through the KV ring, ldmatrix into registers),
``_oregs`` (decode's direct mode storing O from registers instead of bulk copies of smem-staged rows),
``_ring`` / ``_fixed`` (the KV ring when it is not the kernel's default: the alternating ring is
the forward's and decode's direct mode's default, the fixed one decode's split mode's;
``MLA_KERNELS_FWD_RING``, ``MLA_KERNELS_DECODE_RING``).

Per kernel: ``name``, ``arch``, ``registers``, ``spill_bytes`` (stores + loads), ``stack_bytes``,
``smem_bytes`` (dynamic smem of the launch), ``sass`` (instruction counts by full opcode, the
modifiers kept: ``HGMMA.64x64x16.F32.BF16``, ``UTMALDG.3D``, ``UTCHMMA.2CTA`` ...) and
``sass_base`` (counts by mnemonic: ``HGMMA``, ``UTMALDG``, ``LDGSTS``, ``BAR`` ...) and ``barriers``
(every named-barrier instruction: address, ``SYNC``/``ARV``/``RED``, id -- see
:func:`barrier_sites`; :func:`bar_sync_repeats` is the one-address-per-``bar.sync`` rule).
Registers/spills come from ptxas's report (compile option ``remarks{ptx}``); SASS from
``nvdisasm`` (package ``nvidia-cuda-nvdisasm``, installed by the ``test`` extra; without it ``sass``
is null and the printed line says ``SASS: n/a (nvdisasm not installed)``).
Every arch also reports the infrastructure probe kernel, which proves the pipeline
(DSL -> PTX -> cubin -> SASS) works for it.  The sm_100a/sm_103a kernels are proven by this
report only (no Blackwell GPU has run them).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ARCHES = ("sm_90a", "sm_100a", "sm_103a")
#: Mnemonics printed per kernel (the JSON keeps every opcode).
KEY_OPS = ("HGMMA", "UTCHMMA", "UTCBAR", "LDTM", "STTM", "UTMALDG", "UTMASTG", "LDGSTS", "STSM", "REDG", "LDL", "STL")


def kernels_for(arch):
    """(name, builder) pairs; builder(arch, keep=True, dump_dir=...) -> (kernel, compiled)."""
    from mla_kernels.common.probe import compile_probe

    if arch == "sm_90a":
        from mla_kernels.common.index_order import compile_index_order
        from mla_kernels.common.segment_sum import compile_segment_sum
        from mla_kernels.sm90 import (
            compile_attn_dist, compile_bwd, compile_combine, compile_decode, compile_decode_narrow, compile_fwd,
        )

        return [
            ("sm90_fwd_d576_h128", lambda a, **kw: compile_fwd(576, 128, False, False, a, **kw)),
            ("sm90_fwd_d576_h128_topklen_sink", lambda a, **kw: compile_fwd(576, 128, True, True, a, **kw)),
            ("sm90_fwd_d512_h64", lambda a, **kw: compile_fwd(512, 64, False, False, a, **kw)),
            ("sm90_fwd_d576_h128_fixed", lambda a, **kw: compile_fwd(576, 128, False, False, a, ring_alt=False, **kw)),
            # the opt-in rotated pair order on band-ordered slots (order_host.fwd_rotate_shift_for)
            ("sm90_fwd_d576_h128_rot", lambda a, **kw: compile_fwd(576, 128, False, False, a, rotate_shift=12, **kw)),
            ("sm90_attn_dist_d576_h128_heads", lambda a, **kw: compile_attn_dist(576, 128, False, False, a, **kw)),
            ("sm90_attn_dist_d576_h128_heads_persist",
             lambda a, **kw: compile_attn_dist(576, 128, False, False, a, ctas=132, **kw)),
            ("sm90_attn_dist_d576_h128_heads_persist_qscalar",
             lambda a, **kw: compile_attn_dist(576, 128, False, False, a, ctas=132, q_vec=False, **kw)),
            ("sm90_attn_dist_d576_h128_heads_persist_qring",
             lambda a, **kw: compile_attn_dist(576, 128, False, False, a, ctas=132, q_ring=True, **kw)),
            ("sm90_attn_dist_d576_h64_tokens_norm", lambda a, **kw: compile_attn_dist(576, 64, True, True, a, **kw)),
            ("sm90_attn_dist_d576_h64_tokens_persist_qring",
             lambda a, **kw: compile_attn_dist(576, 64, False, False, a, ctas=132, q_ring=True, **kw)),
            ("sm90_attn_dist_d512_h128_heads", lambda a, **kw: compile_attn_dist(512, 128, False, False, a, **kw)),
            ("sm90_bwd_d576_h128", lambda a, **kw: compile_bwd(576, 128, False, arch=a, **kw)),
            ("sm90_bwd_d576_h128_topklen_asum_sink",
             lambda a, **kw: compile_bwd(576, 128, True, True, True, arch=a, **kw)),
            ("sm90_bwd_d576_h128_det", lambda a, **kw: compile_bwd(576, 128, False, deterministic=True, arch=a, **kw)),
            # the kernel that runs by default on band-ordered slots (bwd_host.rotate_shift_for)
            ("sm90_bwd_d576_h128_rot", lambda a, **kw: compile_bwd(576, 128, False, arch=a, rotate_shift=13, **kw)),
            ("sm90_bwd_d576_h128_rot_defer",
             lambda a, **kw: compile_bwd(576, 128, False, arch=a, rotate_shift=13, defer_scatter=True, **kw)),
            ("sm90_bwd_d576_h128_trace", lambda a, **kw: compile_bwd(576, 128, False, arch=a, trace=True, **kw)),
            ("sm90_bwd_d512_h64", lambda a, **kw: compile_bwd(512, 64, False, arch=a, **kw)),
            ("segment_sum_d576", lambda a, **kw: compile_segment_sum(576, a, **kw)),
            ("segment_sum_d576_bf16", lambda a, **kw: compile_segment_sum(576, a, bf16_rows=True, **kw)),
            ("index_order_topklen_perm", lambda a, **kw: compile_index_order(True, True, a, **kw)),
            ("index_order_topklen_perm_stage2048", lambda a, **kw: compile_index_order(True, True, a, stage=2048, **kw)),
            ("sm90_decode_d576_h128_split", lambda a, **kw: compile_decode(576, 128, True, a, **kw)),
            ("sm90_decode_d576_h64_direct", lambda a, **kw: compile_decode(576, 64, False, a, **kw)),
            ("sm90_decode_d512_h128_direct", lambda a, **kw: compile_decode(512, 128, False, a, **kw)),
            ("sm90_decode_d576_h128_direct", lambda a, **kw: compile_decode(576, 128, False, a, **kw)),
            ("sm90_decode_d576_h128_direct_pair",  # a token's two head-block CTAs as one 2-CTA cluster
             lambda a, **kw: compile_decode(576, 128, False, a, pair_cluster=True, **kw)),
            ("sm90_decode_d576_h128_direct_oregs",
             lambda a, **kw: compile_decode(576, 128, False, a, o_bulk=False, **kw)),
            ("sm90_decode_d576_h64_direct_fixed",
             lambda a, **kw: compile_decode(576, 64, False, a, ring_alt=False, **kw)),
            ("sm90_decode_d512_h64_split_ring", lambda a, **kw: compile_decode(512, 64, True, a, ring_alt=True, **kw)),
            ("sm90_decode_d512_h128_fused", lambda a, **kw: compile_decode(512, 128, True, a, fused=True, **kw)),
            ("sm90_decode_d576_h128_cluster16", lambda a, **kw: compile_decode(576, 128, True, a, cluster=16, **kw)),
            ("sm90_decode_d576_h128_cluster16_l2",
             lambda a, **kw: compile_decode(576, 128, True, a, cluster=16, cluster_l2=True, **kw)),
            ("sm90_decode_d576_h128_cluster16_rows32",
             lambda a, **kw: compile_decode(576, 128, True, a, cluster=16, cluster_bf16=True, rows=32, **kw)),
            ("sm90_decode_d576_h64_cluster6",  # 64 heads over 6 CTAs: uneven merge slices
             lambda a, **kw: compile_decode(576, 64, True, a, cluster=6, cluster_bf16=True, **kw)),
            ("sm90_decode_d512_h64_cluster4_bf16",
             lambda a, **kw: compile_decode(512, 64, True, a, cluster=4, cluster_bf16=True, **kw)),
            ("sm90_decode_narrow_d576_h32_split", lambda a, **kw: compile_decode_narrow(576, 32, True, a, **kw)),
            ("sm90_decode_narrow_d576_h16_direct", lambda a, **kw: compile_decode_narrow(576, 16, False, a, **kw)),
            ("sm90_decode_narrow_d512_h32_direct", lambda a, **kw: compile_decode_narrow(512, 32, False, a, **kw)),
            ("sm90_decode_narrow_d576_h8_fused",
             lambda a, **kw: compile_decode_narrow(576, 8, True, a, fused=True, **kw)),
            ("sm90_decode_narrow_d576_h16_cluster16",
             lambda a, **kw: compile_decode_narrow(576, 16, True, a, cluster=16, cluster_bf16=True, **kw)),
            ("sm90_decode_narrow_d576_h8_cluster16",  # more CTAs than heads: half a head's columns each
             lambda a, **kw: compile_decode_narrow(576, 8, True, a, cluster=16, cluster_bf16=True, **kw)),
            ("sm90_decode_narrow_d512_h32_cluster8_f32",
             lambda a, **kw: compile_decode_narrow(512, 32, True, a, cluster=8, **kw)),
            ("combine_f32_bf16_d512", lambda a, **kw: compile_combine(512, "f32", "bf16", a, **kw)),
            ("combine_bf16_bf16_d512", lambda a, **kw: compile_combine(512, "bf16", "bf16", a, **kw)),
        ] + indexer_kernels() + [
            ("probe", lambda a, **kw: compile_probe(a, **kw)),
        ]
    if arch in ("sm_100a", "sm_103a"):
        from mla_kernels.sm100 import compile_attn_dist as sm100_attn_dist
        from mla_kernels.sm100 import compile_bwd as sm100_bwd
        from mla_kernels.sm100 import compile_fwd as sm100_fwd

        return [
            ("sm100_fwd_d576_h64", lambda a, **kw: sm100_fwd(576, 64, False, False, a, **kw)),
            ("sm100_fwd_d576_h128_2cta_topklen_sink", lambda a, **kw: sm100_fwd(576, 128, True, True, a, **kw)),
            ("sm100_fwd_d512_h64", lambda a, **kw: sm100_fwd(512, 64, False, False, a, **kw)),
            ("sm100_fwd_d576_h128_2cta", lambda a, **kw: sm100_fwd(576, 128, False, False, a, **kw)),
            ("sm100_fwd_d512_h256_2cta", lambda a, **kw: sm100_fwd(512, 256, False, False, a, **kw)),
            ("sm100_fwd_d576_h128_1cta_topklen_sink",
             lambda a, **kw: sm100_fwd(576, 128, True, True, a, two_cta=False, **kw)),
            ("sm100_attn_dist_d576_h128", lambda a, **kw: sm100_attn_dist(576, 128, False, False, a, **kw)),
            ("sm100_attn_dist_d576_h64_topklen_norm", lambda a, **kw: sm100_attn_dist(576, 64, True, True, a, **kw)),
            ("sm100_attn_dist_d512_h128", lambda a, **kw: sm100_attn_dist(512, 128, False, False, a, **kw)),
            ("sm100_bwd_d576_h64", lambda a, **kw: sm100_bwd(576, 64, False, arch=a, **kw)),
            ("sm100_bwd_d576_h128_1cta_topklen_asum_sink",
             lambda a, **kw: sm100_bwd(576, 128, True, True, True, arch=a, two_cta=False, **kw)),
            ("sm100_bwd_d576_h64_det", lambda a, **kw: sm100_bwd(576, 64, False, deterministic=True, arch=a, **kw)),
            ("sm100_bwd_d512_h64", lambda a, **kw: sm100_bwd(512, 64, False, arch=a, **kw)),
            ("sm100_bwd_d576_h128_2cta", lambda a, **kw: sm100_bwd(576, 128, False, arch=a, two_cta=True, **kw)),
            ("sm100_bwd_d576_h128_2cta_det",
             lambda a, **kw: sm100_bwd(576, 128, False, deterministic=True, arch=a, two_cta=True, **kw)),
            ("sm100_bwd_d512_h128_2cta_topklen_dlse",
             lambda a, **kw: sm100_bwd(512, 128, True, has_dlse=True, arch=a, two_cta=True, **kw)),
            ("sm100_bwd_d576_h128_2cta_topklen_asum_sink",
             lambda a, **kw: sm100_bwd(576, 128, True, True, True, arch=a, two_cta=True, **kw)),
            ("probe", lambda a, **kw: compile_probe(a, **kw)),
        ]
    return [("probe", lambda a, **kw: compile_probe(a, **kw))]


def indexer_kernels():
    """The sm90 indexer kernels (scores bf16 / fp8, top-k, loss forward / backward)."""
    from mla_kernels.common.key_groups import compile_key_groups
    from mla_kernels.common.segment_sum import compile_fixed_segment_sum
    from mla_kernels.sm90.indexer_loss_bwd import compile_loss_bwd
    from mla_kernels.sm90.indexer_host import KEY_GROUP_CHUNK
    from mla_kernels.sm90.indexer_loss_fwd import compile_loss_fwd
    from mla_kernels.sm90.indexer_score import compile_score
    from mla_kernels.sm90.indexer_topk import compile_topk

    return [
        ("sm90_indexer_score_bf16_h64_d128", lambda a, **kw: compile_score(False, 64, 128, a, **kw)),
        ("sm90_indexer_score_fp8_h64_d128", lambda a, **kw: compile_score(True, 64, 128, a, **kw)),
        ("sm90_indexer_score_bf16_h16_d64", lambda a, **kw: compile_score(False, 16, 64, a, **kw)),
        ("sm90_indexer_score_bf16_h64_d128_hist", lambda a, **kw: compile_score(False, 64, 128, a, hist=True, **kw)),
        ("sm90_indexer_score_fp8_h64_d128_hist", lambda a, **kw: compile_score(True, 64, 128, a, hist=True, **kw)),
        ("sm90_indexer_topk_logits", lambda a, **kw: compile_topk(True, a, **kw)),
        ("sm90_indexer_topk_hist", lambda a, **kw: compile_topk(False, a, pre_hist=True, **kw)),
        ("sm90_indexer_loss_fwd_d128", lambda a, **kw: compile_loss_fwd(128, False, 2048, a, **kw)),
        ("sm90_indexer_loss_fwd_d128_rotate", lambda a, **kw: compile_loss_fwd(128, True, 2048, a, rotate=True, **kw)),
        ("sm90_indexer_loss_bwd_d128", lambda a, **kw: compile_loss_bwd(128, False, False, a, **kw)),
        ("sm90_indexer_loss_bwd_d128_det_topklen", lambda a, **kw: compile_loss_bwd(128, True, True, a, **kw)),
        ("sm90_indexer_loss_bwd_d128_rows_bf16", lambda a, **kw: compile_loss_bwd(128, True, True, a,
                                                                                 dk_mode="slots_bf16", **kw)),
        ("key_groups_count", lambda a, **kw: compile_key_groups(False, False, KEY_GROUP_CHUNK, a, **kw)),
        ("key_groups_place_topklen", lambda a, **kw: compile_key_groups(True, True, KEY_GROUP_CHUNK, a, **kw)),
        ("fixed_segment_sum_d128", lambda a, **kw: compile_fixed_segment_sum(128, a, **kw)),
    ]


def find_nvdisasm():
    exe = shutil.which("nvdisasm")
    if exe:
        return exe
    try:
        import nvidia

        for base in nvidia.__path__:
            hits = glob.glob(os.path.join(base, "**", "bin", "nvdisasm"), recursive=True)
            if hits:
                return hits[0]
    except Exception:
        pass
    return None


_OP = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)")


def sass_counts(sass_text):
    full = collections.Counter()
    for line in sass_text.splitlines():
        m = _OP.match(line)
        if m:
            full[m.group(1)] += 1
    base = collections.Counter()
    for op, n in full.items():
        base[op.split(".")[0]] += n
    return dict(sorted(full.items())), dict(sorted(base.items()))


# A named-barrier instruction: ``BAR.SYNC.DEFER_BLOCKING 0x1, 0x100`` (id, thread count),
# ``BAR.SYNC.DEFER_BLOCKING 0x0`` (__syncthreads), ``BAR.ARV 0x3, 0x100``, ``BAR.SYNC R4, 0x80``
# (id in a register), optionally predicated.
_BAR = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P[0-9T]+\s+)?BAR\.([A-Z]+)[A-Z0-9_.]*\s+([^,;\s]+)\s*(?:,\s*([^;\s]+))?\s*;")
_ADDR = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(\S.*)$")
#: How far back (instructions) a ``BAR.SYNC 0x0`` looks for the ``UCGABAR_WAIT`` it stands in for.
_CLUSTER_FALLBACK_WINDOW = 4


def _imm(tok):
    return int(tok, 16) if tok is not None and tok.startswith("0x") else (int(tok) if tok and tok.isdigit() else None)


def barrier_sites(sass_text):
    """Every named-barrier instruction (``BAR.*``) of a kernel's SASS, in address order.

    Each site: ``addr`` (int), ``op`` (``"SYNC"``, ``"ARV"``, ``"RED"`` ...), ``id`` (int; ``None``
    when the id is a register), ``threads`` (int; ``None`` for all threads or a register),
    ``pred`` (the guard, ``""`` if none) and ``cluster_fallback``: ptxas lowers
    ``barrier.cluster.wait`` to "``UCGABAR_WAIT`` if launched as a cluster, else ``BAR.SYNC 0x0``";
    such a ``BAR.SYNC 0x0`` (a ``UCGABAR_WAIT`` within the few instructions before it) is that
    fallback, not a ``__syncthreads`` of the source."""
    sites = []
    recent = []
    for line in sass_text.splitlines():
        m = _ADDR.match(line)
        if not m:
            continue
        b = _BAR.match(line)
        if b:
            addr, pred, op, ident, count = b.groups()
            bid = _imm(ident)
            sites.append(dict(
                addr=int(addr, 16), op=op, id=bid, threads=_imm(count), pred=(pred or "").strip(),
                cluster_fallback=bool(op == "SYNC" and bid == 0 and any("UCGABAR_WAIT" in r for r in recent)),
            ))
        recent = (recent + [m.group(2)])[-_CLUSTER_FALLBACK_WINDOW:]
    return sites


def bar_sync_repeats(sites, dynamic_ids=()):
    """The rule "every waiting instruction (``BAR.SYNC`` / ``BAR.RED``) of a named barrier id sits
    at one code address": ``{id: [addresses]}`` of the ids that break it.

    ``bar.sync`` is ``barrier.sync.aligned``: every thread taking part in one barrier instance must
    execute the same instruction.  Two roles syncing one id from two code locations (say math warps
    in one function, drain warps in another) is what compute-sanitizer's synccheck reports as
    "Barrier error detected. Divergent thread(s) in block"; the fix is a ``bar.arrive`` by one side
    and ``bar.sync`` by the other, or one call site for both.  The SASS cannot show *which* threads
    reach an address, so an id synced at two addresses by the same threads in the same order is
    also reported -- a caller documents such sites.  ``BAR.ARV`` never counts; cluster-wait
    fallbacks are skipped.  A site whose id is a register counts once for each id in
    ``dynamic_ids`` (the values the source can give it); with no ``dynamic_ids`` such sites are
    reported under the key ``"register"``."""
    where = collections.defaultdict(list)
    for st in sites:
        if st["op"] not in ("SYNC", "RED") or st["cluster_fallback"]:
            continue
        if st["id"] is None:
            for i in (dynamic_ids or ("register",)):
                where[i].append(st["addr"])
        else:
            where[st["id"]].append(st["addr"])
    return {i: sorted(a) for i, a in where.items() if len(a) > 1 or (i == "register")}


class _CaptureFds:
    """Capture what the compiler prints: Python-level sys.stdout/sys.stderr (the DSL prints its
    diagnostics there) and fds 1/2 (native code)."""

    def __enter__(self):
        import io

        self.tmp = tempfile.TemporaryFile(mode="w+b")
        self.py = io.StringIO()
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = (os.dup(1), os.dup(2))
        os.dup2(self.tmp.fileno(), 1)
        os.dup2(self.tmp.fileno(), 2)
        self.saved_py = (sys.stdout, sys.stderr)
        sys.stdout = sys.stderr = self.py
        return self

    def __exit__(self, *exc):
        sys.stdout, sys.stderr = self.saved_py
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self.saved[0], 1)
        os.dup2(self.saved[1], 2)
        os.close(self.saved[0])
        os.close(self.saved[1])
        self.tmp.seek(0)
        self.text = self.py.getvalue() + self.tmp.read().decode(errors="replace")
        self.tmp.close()
        return False


def report_one(name, builder, arch, nvdisasm):
    dump = tempfile.mkdtemp(prefix=f"mlak_{name}_")
    t0 = time.time()
    with _CaptureFds() as cap:
        kernel, compiled = builder(arch, keep=True, dump_dir=dump, extra_options="remarks{ptx}")
    secs = time.time() - t0
    log = cap.text
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    spills = [(int(a), int(b)) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
    stacks = [int(x) for x in re.findall(r"(\d+) bytes stack frame", log)]
    rec = dict(
        name=name,
        arch=arch,
        registers=max(regs) if regs else None,
        spill_bytes=sum(a + b for a, b in spills) if spills else None,
        stack_bytes=max(stacks) if stacks else None,
        smem_bytes=getattr(kernel, "smem_bytes", None),
        compile_seconds=round(secs, 2),
        sass=None,
        sass_base=None,
        barriers=None,
        special_regs=None,
    )
    cubins = glob.glob(os.path.join(dump, "*.cubin"))
    if nvdisasm and cubins:
        out = subprocess.run([nvdisasm, "-c", cubins[0]], capture_output=True, text=True)
        rec["sass"], rec["sass_base"] = sass_counts(out.stdout)
        rec["barriers"] = barrier_sites(out.stdout)
        rec["special_regs"] = dict(collections.Counter(re.findall(r"\bSR_[A-Z0-9_]+", out.stdout)))
    shutil.rmtree(dump, ignore_errors=True)
    return rec


def run(arch, only=None, json_path=None, quiet=False):
    nvdisasm = find_nvdisasm()
    if nvdisasm is None and not quiet:
        print("note: nvdisasm not found (pip install nvidia-cuda-nvdisasm); SASS counts omitted")
    recs = []
    for name, builder in kernels_for(arch):
        if only and name not in only:
            continue
        recs.append(report_one(name, builder, arch, nvdisasm))
        if not quiet:
            r = recs[-1]
            if r["sass_base"] is None:
                sass = "SASS: n/a (nvdisasm not installed)"
            else:
                sass = str({k: r["sass_base"].get(k, 0) for k in KEY_OPS})
            rep = bar_sync_repeats(r["barriers"]) if r["barriers"] is not None else {}
            bars = ("  bar.sync sites to review: "
                    + ", ".join(f"{i}@{'/'.join(hex(a) for a in addrs)}" for i, addrs in sorted(rep.items(), key=str))
                    if rep else "")
            print(f"{r['name']:<44} {arch} regs={r['registers']} spill={r['spill_bytes']}B "
                  f"smem={r['smem_bytes']}B {r['compile_seconds']}s  {sass}{bars}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(recs, f, indent=1)
        if not quiet:
            print(f"wrote {json_path}")
    return recs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", required=True, choices=ARCHES, help="target architecture")
    ap.add_argument("--json", default="", metavar="FILE", help="write the records as a JSON list to this file")
    ap.add_argument("--only", default="", metavar="NAME[,NAME...]",
                    help="comma-separated kernel names of --arch (default: all; an unknown name is an error "
                         "that lists the names)")
    args = ap.parse_args(argv)
    only = None
    if args.only:
        names = [n for n, _ in kernels_for(args.arch)]
        only = {n.strip() for n in args.only.split(",") if n.strip()}
        bad = sorted(only - set(names))
        if bad or not only:
            ap.error(f"unknown kernel {', '.join(map(repr, bad)) or repr(args.only)} for {args.arch}; "
                     f"choose from: {', '.join(names)}")
    run(args.arch, only, args.json or None)


if __name__ == "__main__":
    main()
