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
