"""The benchmark tool's CPU path (the README's main job on a machine without a GPU)."""

from __future__ import annotations

import importlib.util
import json
import os

ROOT = os.path.join(os.path.dirname(__file__), "..")


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_quick_on_cpu(tmp_path, capsys):
    bench = load("bench")
    out = tmp_path / "b.json"
    bench.main(["--quick", "--cpu", "--reps", "20", "--warmup", "1", "--sets", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert "CPU PyTorch reference only" in text
    data = json.loads(out.read_text())
    ops = {(r["shape"], r["op"]) for r in data["rows"]}
    assert ops == {(s, o) for s in ("quick-a", "quick-b") for o in ("fwd", "attn_dist", "bwd")}
    assert all(r["tflops"] > 0 and r["reps"] >= 20 for r in data["rows"])
    assert bench.flops("fwd", 4096, 128, 2048, 576, 512) == 2.0 * 4096 * 128 * 2048 * 1088
