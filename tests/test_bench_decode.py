"""tools/bench_decode.py on the CPU: the rows(args) interface tools/bench.py uses, the CLI, the
FLOP / byte conventions."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

ROOT = os.path.join(os.path.dirname(__file__), "..")


def load():
    spec = importlib.util.spec_from_file_location("bench_decode", os.path.join(ROOT, "tools", "bench_decode.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rows_interface_on_cpu(capsys):
    bd = load()
    rows = bd.rows(argparse.Namespace(reps=20, warmup=1, sets=2, cpu=True))
    assert "CPU PyTorch reference only" in capsys.readouterr().out
    assert [r["shape"] for r in rows] == [c[0] for c in bd.QUICK]
    for r in rows:
        assert r["op"] == "decode" and r["backend"] == "reference" and r["us"] > 0 and r["reps"] >= 20
        assert r["tflops"] == bd.flops(r["b"], r["s_q"], r["h_q"], r["topk"]) / (r["us"] * 1e-6) / 1e12
        assert r["gbps"] > 0 and r["num_splits"] >= 1


def test_cli_json_and_conventions(tmp_path):
    bd = load()
    out = tmp_path / "d.json"
    bd.main(["--cpu", "--reps", "20", "--warmup", "1", "--sets", "1", "--cases", "quick-b2-h16", "--json", str(out)])
    data = json.loads(out.read_text())
    assert [r["shape"] for r in data["rows"]] == ["quick-b2-h16"]
    assert bd.flops(128, 2, 128, 2048) == 2.0 * 128 * 2 * 128 * 2048 * (576 + 512)
    assert bd.gathered_bytes(128, 1, 2048) == 128 * 2048 * 576 * 2
    assert bd.hbm_of("NVIDIA H200") == 4.8e12 and bd.hbm_of("NVIDIA H100 80GB HBM3") == 3.35e12
    names = [c[0] for c in bd.CASES]
    assert "v32-b128-sq2-h128" in names and "b128-sq1-h16" in names and "b1-sq1-h128" not in names
