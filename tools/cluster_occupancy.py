#!/usr/bin/env python3
"""How many thread-block clusters of 2, 4, 8 and 16 CTAs fit on this GPU at once at one CTA per SM
(the 64-head decode kernels' occupancy): ``common/decode_host.max_active_clusters``, the
driver's ``cuOccupancyMaxActiveClusters`` for a do-nothing probe kernel.  The decode plan's
``auto`` combine rule merges in clusters only when all of a plan's clusters fit.

  python tools/cluster_occupancy.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from mla_kernels.common import decode_host as dh  # noqa: E402


def main() -> int:
    if not torch.cuda.is_available():
        print("cluster_occupancy: needs a CUDA GPU")
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    p = torch.cuda.get_device_properties(dev)
    print(f"GPU: {p.name}, {p.multi_processor_count} SMs")
    for smem in (dh.PROBE_SMEM, 100 * 1024):
        fits = {c: dh.max_active_clusters(dev, c, smem=smem) for c in (1, 2, 4, 8, 16)}
        print(f"smem {smem} B, {dh.PROBE_THREADS} threads: max active clusters "
              + ", ".join(f"{c}: {n}" for c, n in fits.items()), flush=True)
        for k, e in dh._fit_errors.items():
            print(f"  probe {k} failed: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
