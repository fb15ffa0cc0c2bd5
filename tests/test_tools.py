"""The tools on the CPU: bench.py (the README's main job without a GPU: argument errors, progress,
the per-op tables, families from tools/bench_<family>.py, --plot) and compile_report.py's CLI."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_bench_quick_on_cpu(tmp_path, capsys):
    bench = load("bench")
    out = tmp_path / "b.json"
    bench.main(["--quick", "--cpu", "--reps", "20", "--warmup", "1", "--sets", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert "CPU PyTorch reference only" in text and "GFLOP/s" in text and "not the kernels" in text
    assert "[  1 " in text and "shape 1/2] quick-a fwd reference" in text  # progress lines
    data = json.loads(out.read_text())
    ops = {(r["shape"], r["op"]) for r in data["rows"]}
    assert ops == {(s, o) for s in ("quick-a", "quick-b") for o in ("fwd", "attn_dist", "bwd")}
    assert all(r["impl"] == "reference" and r["ms"] > 0 and r["reps"] >= 20 for r in data["rows"])
    assert data["meta"]["what"].startswith("PyTorch reference on the CPU")
    assert bench.flops("fwd", 4096, 128, 2048, 576, 512) == 2.0 * 4096 * 128 * 2048 * 1088


@pytest.mark.parametrize("argv,words", [
    (["--ops", "bogus"], "unknown op 'bogus'; choose from: fwd, attn_dist, bwd, bwd_det"),
    (["--ops", "fwd,nope"], "unknown op 'nope'"),
    (["--shapes", "bogus"], "unknown shape 'bogus'; choose from: v32-h128-kv8k"),
    (["--reps", "5"], "--reps must be >= 20"),
])
def test_bench_argument_errors_list_the_choices(argv, words, capsys):
    bench = load("bench")
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_bench_help_documents_every_option(capsys):
    bench = load("bench")
    ap = bench.build_parser({})
    for action in ap._actions:
        assert action.help, f"{action.option_strings} has no help text"
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    assert "bench_<family>.py" in capsys.readouterr().out


FAMILY = textwrap.dedent('''
    DESCRIPTION = "fake decode rows"
    SHAPES = ("fake-b1", "fake-b64")

    def bench_rows(ctx):
        rows = []
        for k, shape in enumerate(SHAPES):
            if not ctx.wants(shape):
                continue
            med, times = ctx.time(lambda i: sum(range(100)))
            assert med >= 0 and len(times) == ctx.reps
            ctx.progress(f"{shape} timed")
            for j, impl in enumerate(("ours", "flashmla", "cudnn", "reference")):
                rows.append(dict(op="decode", shape=shape, impl=impl, ms=1.0 + k + j, flops=2e9 * (4 - j),
                                 extra_key=j))
        return rows
''')


def test_bench_picks_up_family_modules_and_plots(tmp_path, capsys):
    bench = load("bench")
    (tmp_path / "bench_fake.py").write_text(FAMILY)
    png, js = tmp_path / "b.png", tmp_path / "b.json"
    rows = bench.main(["--cpu", "--ops", "fake,fwd", "--shapes", "fake-b64,quick-a", "--reps", "20", "--warmup", "0",
                       "--sets", "1", "--plot", str(png), "--json", str(js)], family_dirs=[tmp_path])
    text = capsys.readouterr().out
    fam = [r for r in rows if r["op"] == "decode"]
    assert {r["shape"] for r in fam} == {"fake-b64"} and len(fam) == 4 and fam[0]["family"] == "fake"
    assert "fake-b64 timed" in text
    table = text[text.index("decode: ms / GFLOP/s"):]
    header = table.splitlines()[1]
    assert header.index("ours") < header.index("flashmla") < header.index("cudnn") < header.index("reference")
    assert {r["shape"] for r in rows if r["op"] == "fwd"} == {"quick-a"}
    assert png.exists() and png.stat().st_size > 10_000
    assert json.loads(js.read_text())["rows"][-1]["extra_key"] == 3
    # a family's choices appear in the parser
    ap = bench.build_parser(bench.load_families([tmp_path]))
    assert "fake: fake decode rows" in ap.format_help().replace("\n", " ").replace("  ", " ") or "fake" in ap.format_help()


def test_bench_rejects_malformed_family_rows(tmp_path):
    bench = load("bench")
    (tmp_path / "bench_bad.py").write_text("def bench_rows(ctx):\n    return [dict(op='x', shape='s')]\n")
    with pytest.raises(ValueError, match=r"bench_bad.py returned a row without \['impl', 'ms'\]"):
        bench.main(["--cpu", "--ops", "bad", "--reps", "20"], family_dirs=[tmp_path])


def test_flashmla_anchor_output_parsing():
    bench = load("bench")
    text = "FlashMLA sparse prefill\n4096 32768 2048 128 4.210 555.1 4.182\n64 32768 2048 64 0.1 1.0 0.09\n"
    assert bench.parse_anchor_line(text, (4096, 32768, 2048, 128)) == 4.182
    assert bench.parse_anchor_line(text, (64, 32768, 2048, 64)) == 0.09
    assert bench.parse_anchor_line(text, (1, 2, 3, 4)) is None
    assert bench.parse_anchor_line("garbage line here x y z w", (1, 2, 3, 4)) is None


def test_compile_report_cli_errors_and_no_nvdisasm(capsys, monkeypatch):
    pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl is not installed")
    cr = load("compile_report")
    with pytest.raises(SystemExit) as e:
        cr.main(["--arch", "sm_90a", "--only", "bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "unknown kernel 'bogus'" in err and "sm90_fwd_d576_h128" in err
    with pytest.raises(SystemExit):
        cr.main(["--arch", "sm_80"])
    assert "invalid choice" in capsys.readouterr().err
    monkeypatch.setattr(cr, "find_nvdisasm", lambda: None)
    recs = cr.run("sm_90a", only={"probe"})
    out = capsys.readouterr().out
    assert recs[0]["sass"] is None
    assert "SASS: n/a (nvdisasm not installed)" in out and "HGMMA" not in out.split("probe", 1)[1]


def test_fwd_method_check_cli_on_cpu(capsys, monkeypatch):
    """The forward timing-method diagnostic: --help works, and without a GPU it stops with a clear
    message instead of a traceback."""
    mod = load("fwd_method_check")
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0 and "--bin" in capsys.readouterr().out
    monkeypatch.setattr(mod.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        mod.main(["--bin", "/nonexistent"])
    assert "needs a CUDA GPU" in str(e.value.code)


def test_bench_back_to_back_on_cpu(tmp_path, capsys):
    """--b2b N: each sample is N calls back to back (the FlashMLA binary's method); recorded in the
    rows and the metadata; a negative N is refused."""
    bench = load("bench")
    out = tmp_path / "b.json"
    bench.main(["--quick", "--cpu", "--ops", "fwd", "--reps", "20", "--warmup", "1", "--sets", "2", "--b2b", "3",
                "--json", str(out)])
    assert "3 calls back to back per sample" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["meta"]["b2b"] == 3 and data["rows"] and all(r["b2b"] == 3 and r["ms"] > 0 for r in data["rows"])
    calls = []
    med, times = bench.time_fn(lambda i: calls.append(i), 2, 0, 4, bench.torch.device("cpu"), b2b=3)
    assert calls == [0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1] and len(times) == 4  # 4 samples x 3 calls, sets rotate
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--cpu", "--b2b", "-1"])


def test_ab_bench_shape_names():
    """ab_bench takes tools/bench.py's shapes and the V3.2 shape at any h_q / s_kv by name."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))  # ab_bench imports bench from its directory
    try:
        ab = load("ab_bench")
    finally:
        sys.path.pop(0)
    assert ab.shape_by_name("v32-h128-kv32k") == ("v32-h128-kv32k", 4096, 128, 2048, 576, 512, 32768)
    assert ab.shape_by_name("v32-h64-kv256k") == ("v32-h64-kv256k", 4096, 64, 2048, 576, 512, 262144)
    assert ab.shape_by_name("v32-h64-kv") is None and ab.shape_by_name("quick-a") is None


def test_ab_bench_variant_specs_and_knobs(monkeypatch):
    """ab_bench's NAME=DIR[@K=V;K=V] variants: the knobs are set around a variant's calls only."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))  # ab_bench imports bench from its directory
    try:
        ab = load("ab_bench")
    finally:
        sys.path.pop(0)
    assert ab.parse_variant("new=.") == ("new", ".", {})
    assert ab.parse_variant("p=.@MLA_KERNELS_ATTN_DIST_CTAS=auto;X=1") == (
        "p", ".", {"MLA_KERNELS_ATTN_DIST_CTAS": "auto", "X": "1"})
    assert ab.parse_variant("c=@cudnn") == ("c", "@cudnn", {})
    for bad in ("=.", "x=", "x=.@=1"):
        with pytest.raises(SystemExit):
            ab.parse_variant(bad)
    monkeypatch.setenv("AB_KNOB_A", "before")
    monkeypatch.delenv("AB_KNOB_B", raising=False)
    with ab._Knobs({"AB_KNOB_A": "in", "AB_KNOB_B": "in"}):
        assert os.environ["AB_KNOB_A"] == "in" and os.environ["AB_KNOB_B"] == "in"
    assert os.environ["AB_KNOB_A"] == "before" and "AB_KNOB_B" not in os.environ


def test_host_time_cli_on_cpu_and_its_stage_wrappers(capsys, monkeypatch):
    """The host-time diagnostic: --help works, without a GPU it says so (exit 0, no traceback), and
    its stage timers wrap the host path's functions and put every one of them back."""
    mod = load("host_time")
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0 and "--breakdown" in capsys.readouterr().out
    monkeypatch.setattr(mod.torch.cuda, "is_available", lambda: False)
    assert mod.main([]) == 0 and "needs a GPU" in capsys.readouterr().out
    stages = mod._Stages()
    before = [(obj, attr, obj.__dict__.get(attr)) for obj, attr in stages.targets]
    assert sum(f is not None for _, _, f in before) >= 12  # the names still exist in the package
    from mla_kernels import api

    orig = api.check_inputs
    with stages:
        assert api.check_inputs is not orig  # wrapped while inside
    assert api.check_inputs is orig
    assert all(obj.__dict__.get(attr) is f for obj, attr, f in before)


def test_decode_variants_still_apply_to_the_tree(tmp_path):
    """Every phase-dropping edit of tools/decode_variants.py still matches the kernels' source
    (a stale edit would stop the profiling by subtraction), alone and joined by '+'."""
    mod = load("decode_variants")
    names = list(mod.EDITS) + ["empty+noq+nomerge+nosync+nostage"]
    mod.make(str(tmp_path), names)
    for name in names:
        for part in name.split("+"):
            for f in mod.EDITS[part]:
                edited = open(os.path.join(tmp_path, name, f)).read()
                assert edited != open(os.path.join(ROOT, f)).read(), (name, part, f)
    with pytest.raises(SystemExit, match="unknown variant"):
        mod.make(str(tmp_path), ["noq+bogus"])


def test_trace_bwd_says_it_needs_a_gpu(capsys):
    """tools/trace_bwd.py without a GPU: a clear message and exit status 2."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the tool would run (measured on the GPU host, docs/PERF.md)")
    assert load("trace_bwd").main([]) == 2
    assert "no CUDA device" in capsys.readouterr().out
