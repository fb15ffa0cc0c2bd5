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
