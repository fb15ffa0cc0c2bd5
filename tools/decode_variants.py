#!/usr/bin/env python3
"""Patched copies of the decode path that drop one phase each, for tools/ab_decode.py (profiling
by subtraction: the time a phase costs is the full step's minus the variant's).

  python tools/decode_variants.py OUT_DIR        # then: tools/ab_decode.py --variant NAME=OUT_DIR/NAME ...

Variants (each a copy of this checkout's ``mla_kernels`` with one edit; results are wrong by
design, only the timing means something):

* ``base``     -- ``git HEAD``'s package unchanged (the reference of an A/B against the work tree)
* ``nocomb``   -- the split step without its combine launch
* ``nogather`` -- the KV cp.async copies read nothing (zero-fill), index and block-table loads kept
* ``noload``   -- no KV reads and no index / block-table loads (every slot row 0, valid)
* ``nostore``  -- the epilogue's O stores dropped (64-head kernel and narrow kernel)
* ``empty``    -- every split processes no block (launch, Q load, epilogue, combine only)
* ``nosoftmax``-- the 64-head kernel's online softmax skipped (masks and PV kept)
* ``halfrows`` -- the KV gather copies only rows 0..31 of each 64-row block (no copy issued for the
                 rest): the bound of a 2-CTA gather that shares each block (each CTA issues half)
* ``halfbytes``-- the same rows read nothing (zero-fill copies still issued): half the bytes alone
* ``rot2`` / ``rot6`` -- (64-head kernel, 32 full blocks only: topk 2048, one split) the second
                 64-head CTA of a token takes its blocks rotated by -2 / -6, so that after its first
                 2 / 6 blocks it trails its partner CTA by that many and finds their rows in L2
* ``noq``      -- no Q load (both kernels; the MMAs read whatever the smem holds)
* ``nopre``    -- the combine without its part prefetch (``PREFETCH = 0``: three L2 round trips)
* ``nomerge``  -- the cluster merge (``cluster_merge.merge_slice``) dropped; its two cluster barriers kept
* ``nosync``   -- the cluster barriers dropped (timing only: with ``nomerge``, nothing reads a peer)
* ``nostage``  -- the cluster CTAs do not stage their partial O in shared memory
* ``noremote`` -- the merge reads its own staged rows instead of the peers' (no DSMEM data traffic)
* ``nodata``   -- the merge loads no row data (the peers' lse loads, the weights and the stores kept)
* ``nogstore`` -- the merge stores no output rows (its sums, then dead, go with them)

Names joined by ``+`` (``empty+noq+nomerge``) apply several edits to one copy.

Note: a variant that leaves a result unused lets the compiler drop the work behind it too (``nostore``
removes the PV products with the O stores: check a variant's SASS with tools/compile_report.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import io

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DP = "mla_kernels/common/decode_parts.py"
DH = "mla_kernels/common/decode_host.py"
DD = "mla_kernels/common/decode_device.py"
DEC = "mla_kernels/sm90/decode.py"
NAR = "mla_kernels/sm90/decode_narrow.py"
CM = "mla_kernels/common/cluster_merge.py"

EDITS = {
    "nocomb": {DH: [('        st["combine"](c["parts3"]', '        0 and st["combine"](c["parts3"]', 1)]},
    "nogather": {DP: [("                    self.ok[slot_b, j],\n                    self.policy,",
                       "                    Boolean(False),\n                    self.policy,", 1)]},
    "noload": {
        DP: [("                    self.ok[slot_b, j],\n                    self.policy,",
              "                    Boolean(False),\n                    self.policy,", 1),
             ("    def index_at(self, slot):\n        pos = self.fetch_slot(slot)",
              "    def index_at(self, slot):\n        return Int32(0), slot < self.topk_len\n        pos = self.fetch_slot(slot)",
              1)],
    },
    "nostore": {
        DEC: [("                dev.st_global_v4_f32(addr, v0, v1, v2, v3)", "                pass", 1),
              ("                dev.st_global_v2_b32(addr, dev.pack_bf16x2(v0, v1), dev.pack_bf16x2(v2, v3))",
               "                pass", 1)],
        NAR: [("                cute.autovec_copy(rv, cute.make_tensor((mO.iterator + off).align(16), vec))",
               "                pass", 1),
              ("                cute.autovec_copy(rb, cute.make_tensor((mO.iterator + off).align(8), vec))",
               "                pass", 1)],
    },
    "empty": {DP: [("    return blk0, (n_blocks + 1) // 2, bound", "    return blk0, Int32(0) * n_blocks, bound", 1)]},
    "noq": {DEC: [("            dp.load_q_tile(", "            (lambda *a: None)(", 1)],
            NAR: [("            dp.load_q_tile(", "            (lambda *a: None)(", 1)]},
    "nopre": {"mla_kernels/common/combine.py": [("PREFETCH = 16\n", "PREFETCH = 0\n", 1)]},
    "nomerge": {DEC: [("        cm.merge_slice(", "        (lambda *a, **k: None)(", 1)]},
    "nosync": {DEC: [("cm.cluster_sync(True)", "(lambda *a: None)(True)", 2),
                     ("cm.cluster_sync(False)", "(lambda *a: None)(False)", 3)]},
    "nostage": {CM: [("        stage_o_v4(x_addr, row,", "        (lambda *a: None)(x_addr, row,", 1)]},
    "noremote": {CM: [("        base = dev.mapa_shared(local, Int32(p))", "        base = local + Int32(0) * p", 1)]},
    "nodata": {CM: [("                v = dev.ld_cluster_v4_bf16x2_f32(base + k * tph * 16)", "                v = [w] * 8", 1),
                    ("                v = dev.ld_cluster_v4_f32(base + k * tph * 16)", "                v = [w] * 4", 1)]},
    "nogstore": {CM: [("            dev.st_global_v4_b32(a, dev.pack", "            (lambda *a: None)(a, dev.pack", 1),
                      ("            dev.st_global_v2_b32(a, dev.pack", "            (lambda *a: None)(a, dev.pack", 1)]},
    "halfrows": {DP: [("            for j in range(self.rows_per_thread):\n                cp_async_16_zfill_pf(",
                       "            for j in range(self.rows_per_thread // 2):\n                cp_async_16_zfill_pf(", 1)]},
    "halfbytes": {DP: [("                    self.ok[slot_b, j],\n                    self.policy,",
                        "                    self.ok[slot_b, j] & Boolean(j < self.rows_per_thread // 2),\n                    self.policy,", 1)]},
    "rot2": {DD: [("    gather.load_indices(blk, 0)\n    gather.load_indices(blk + 1, 1)",
                    "    blk = (blk + gather.rot) % 32\n    gather.load_indices(blk, 0)\n    gather.load_indices(blk + 1, 1)", 1)],
              DEC: [("            dd.paired_producer_loop(gather,", "            gather.rot = (h_blk % 2) * 30\n            dd.paired_producer_loop(gather,", 1)]},
    "rot6": {DD: [("    gather.load_indices(blk, 0)\n    gather.load_indices(blk + 1, 1)",
                    "    blk = (blk + gather.rot) % 32\n    gather.load_indices(blk, 0)\n    gather.load_indices(blk + 1, 1)", 1)],
              DEC: [("            dd.paired_producer_loop(gather,", "            gather.rot = (h_blk % 2) * 26\n            dd.paired_producer_loop(gather,", 1)]},
    "nosoftmax": {DD: [("        dev.online_softmax(acc_s, acc_o, rM, rL, scale_log2, rM[0], rM[1])\n", "", 1),
                       ("        dev.online_softmax(acc_s, acc_o, rM, rL, scale_log2, sM0[row0], sM0[row1])\n",
                        "", 1)]},
}


def copy_pkg(dst: str) -> None:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(os.path.join(ROOT, "mla_kernels"), os.path.join(dst, "mla_kernels"),
                    ignore=shutil.ignore_patterns("__pycache__"))


def make(out: str, names=None) -> None:
    os.makedirs(out, exist_ok=True)
    if names is None or "base" in names:
        dst = os.path.join(out, "base")
        shutil.rmtree(dst, ignore_errors=True)
        os.makedirs(dst)
        blob = subprocess.run(["git", "-C", ROOT, "archive", "HEAD", "mla_kernels"], check=True,
                              capture_output=True).stdout
        tarfile.open(fileobj=io.BytesIO(blob)).extractall(dst)
    wanted = list(EDITS) if names is None else [n for n in names if n != "base"]
    for name in wanted:
        parts = name.split("+")
        unknown = [x for x in parts if x not in EDITS]
        if unknown:
            raise SystemExit(f"unknown variant(s) {unknown}; choose from {', '.join(EDITS)} (joined by '+')")
        dst = os.path.join(out, name)
        copy_pkg(dst)
        for part in parts:
            for f, edits in EDITS[part].items():
                p = os.path.join(dst, f)
                s = open(p).read()
                for a, b, n in edits:
                    assert s.count(a) == n, (name, f, a, s.count(a))
                    s = s.replace(a, b)
                open(p, "w").write(s)
    print(f"variants in {out}")


if __name__ == "__main__":
    make(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, ".var"), sys.argv[2:] or None)
