"""examples/context_parallel.py under torchrun with 2 gloo processes on the CPU (the reference
path): the KV sharded by token range, partials merged with merge_attn_partials, the backward
with the merged out/lse -- forward, dq, dkv, d_attn_sink and a decode step checked against the
single-process result.  (The NCCL version is the same command on a 2-GPU host without --cpu.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def test_context_parallel_example_two_gloo_ranks():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    env = dict(os.environ, OMP_NUM_THREADS="1", MLA_KERNELS_BACKEND="reference")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", "context_parallel.py"), "--cpu", "--small"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "PASS: context parallel matches the single-process result" in out, out[-3000:]
    assert "FAIL" not in out
    for name in ("train forward out", "train dq", "train dkv", "train d_attn_sink", "decode out", "decode lse"):
        assert out.count(f"PASS {name}") == 2, name  # both ranks
