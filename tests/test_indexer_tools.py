"""tools/bench_indexer.py's CPU path (tiny shape on the reference) and its row format."""

from __future__ import annotations

import importlib.util
import json
import os

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_bench_indexer_on_cpu(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_indexer", os.path.join(ROOT, "tools", "bench_indexer.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "b.json"
    mod.main(["--reps", "2", "--warmup", "0", "--sets", "1", "--json", str(out)])
    assert "CPU PyTorch reference only" in capsys.readouterr().out
    data = json.loads(out.read_text())
    cases = {r["case"] for r in data["rows"]}
    assert cases == {"topk_bf16", "topk_fp8", "loss_fwd", "loss_fwd_bwd", "loss_fwd_bwd_det"}
    assert all(r["backend"] == "reference" and r["ms"] > 0 and r["op"] == "indexer" for r in data["rows"])


def test_sanitize_indexer_log_parser():
    spec = importlib.util.spec_from_file_location("sanitize_indexer",
                                                  os.path.join(ROOT, "tools", "sanitize_indexer.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    log = "\n".join([
        "========= COMPUTE-SANITIZER",
        '========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call to '
        "cuGetProcAddress_v2.",
        "=========     Saved host backtrace up to driver entry point at error",
        f"{mod.MARK} BEGIN loss fwd",
        "========= Invalid __global__ read of size 4 bytes",
        "=========     at kernel+0x10",
        f"{mod.MARK} END loss fwd | check: ok",
        f"{mod.MARK} BEGIN topk",
        f"{mod.MARK} END topk | check: FAILED",
        "========= ERROR SUMMARY: 2 errors",
    ])
    per, summary, stray, probes = mod.parse(log)
    assert probes == 1 and stray == [] and summary == "ERROR SUMMARY: 2 errors"
    assert per["loss fwd"][:2] == [1, 0] and per["loss fwd"][3] == "ok" and per["topk"][3] == "FAILED"


def test_bench_py_runs_the_indexer_family_on_cpu(tmp_path, capsys):
    import sys

    spec = importlib.util.spec_from_file_location("bench", os.path.join(ROOT, "tools", "bench.py"))
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = bench  # dataclasses look their module up
    spec.loader.exec_module(bench)
    assert "indexer" in bench.load_families()
    out = tmp_path / "b.json"
    bench.main(["--cpu", "--ops", "indexer", "--reps", "20", "--warmup", "0", "--sets", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {r["op"] for r in rows} == {"indexer_topk_bf16", "indexer_topk_fp8", "indexer_loss_fwd",
                                       "indexer_loss_fwd_bwd", "indexer_loss_fwd_bwd_det"}
    assert all(r["impl"] == "reference" and r["ms"] > 0 and r["family"] == "indexer" for r in rows)


def test_bench_indexer_shuffled_slots(tmp_path, capsys):
    """``--cases loss_shuffled``: each row's valid slots and their targets permuted together
    (the -1 padding kept at the end), so the loss and its gradients are those of the sorted
    slots; the rows run on the CPU reference."""
    import torch

    import mla_kernels as mk

    spec = importlib.util.spec_from_file_location("bench_indexer", os.path.join(ROOT, "tools", "bench_indexer.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    g = torch.Generator().manual_seed(0)
    s_q, s_kv, topk = 40, 90, 32
    ln = torch.randint(0, topk + 1, (s_q,), generator=g).int()
    idx = torch.full((s_q, topk), -1, dtype=torch.int32)
    tgt = torch.zeros(s_q, topk)
    for t in range(s_q):
        n = int(ln[t])
        idx[t, :n] = torch.randperm(s_kv, generator=g)[:n].sort().values.int()
        tgt[t, :n] = torch.rand(n, generator=g)
    si, st = mod.shuffle_slots(idx, tgt, ln, seed=3)
    assert not torch.equal(si, idx)
    for t in range(s_q):
        n = int(ln[t])
        assert (si[t, n:] == -1).all() and (st[t, n:] == 0).all()
        assert sorted(si[t, :n].tolist()) == idx[t, :n].tolist()
        pairs = dict(zip(idx[t, :n].tolist(), tgt[t, :n].tolist()))
        assert all(pairs[i] == v for i, v in zip(si[t, :n].tolist(), st[t, :n].tolist()))
    q = torch.randn(s_q, 64, 64, dtype=torch.float64, generator=g)
    k = torch.randn(s_kv, 64, dtype=torch.float64, generator=g)
    w = torch.randn(s_q, 64, dtype=torch.float64, generator=g)
    a = mk.indexer_loss(q, k, w, idx, tgt.double(), topk_length=ln, reduction="none")
    b = mk.indexer_loss(q, k, w, si, st.double(), topk_length=ln, reduction="none")
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    out = tmp_path / "b.json"
    mod.main(["--reps", "1", "--warmup", "0", "--sets", "1", "--cases", "loss_shuffled", "--json", str(out)])
    cases = {r["case"] for r in json.loads(out.read_text())["rows"]}
    assert cases == {"loss_fwd_shuffled", "loss_fwd_bwd_shuffled", "loss_fwd_bwd_det_shuffled"}


def test_score_clock_says_it_needs_a_gpu(capsys):
    """tools/score_clock.py on a machine without a GPU: a clear message and exit status 2."""
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the tool would run (measured on the GPU host, docs/PERF.md)")
    spec = importlib.util.spec_from_file_location("score_clock", os.path.join(ROOT, "tools", "score_clock.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
