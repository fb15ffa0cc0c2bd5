"""The on-disk compile cache (mla_kernels/_compile.py): keys, locking, corrupt entries, and a
real export_to_c -> load_module round trip of a CuTe DSL kernel on the CPU (loading needs no GPU;
calling does: the GPU test times a second process's first call)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mla_kernels import _compile

from conftest import skip_unless_sm90

ROOT = Path(__file__).resolve().parent.parent


def _pickle_store(root, **kw):
    import pickle

    def export(obj, path):
        Path(path).write_bytes(pickle.dumps(obj))

    def load(path):
        return pickle.loads(Path(path).read_bytes())

    kw.setdefault("link", False)
    return _compile.DiskStore(root, fingerprint="f" * 40, export=export, load=load, **kw)


def test_store_builds_once_then_loads(tmp_path):
    st = _pickle_store(tmp_path)
    calls = []
    assert st.get_or_build(("k", 1), lambda: calls.append(1) or {"v": 1}) == {"v": 1}
    assert st.get_or_build(("k", 1), lambda: calls.append(1) or {"v": 2}) == {"v": 1}  # from disk
    assert calls == [1]
    obj, meta, _ = st.paths(("k", 1))
    info = json.loads(meta.read_text())
    assert obj.exists() and info["key"] == repr(("k", 1)) and info["size"] == obj.stat().st_size
    assert st.get_or_build(("k", 2), lambda: {"v": 3}) == {"v": 3}  # another key, another entry


@pytest.mark.parametrize("damage", ["flip", "truncate", "bad_json", "foreign_key", "load_fails"])
def test_corrupt_entry_is_rebuilt_never_loaded(tmp_path, damage):
    st = _pickle_store(tmp_path)
    st.get_or_build("key", lambda: "good")
    obj, meta, _ = st.paths("key")
    loaded = []
    real_load = st.load
    st.load = lambda p: loaded.append(p) or real_load(p)
    if damage == "flip":
        data = bytearray(obj.read_bytes())
        data[len(data) // 2] ^= 0xFF
        obj.write_bytes(bytes(data))
    elif damage == "truncate":
        obj.write_bytes(obj.read_bytes()[:5])
    elif damage == "bad_json":
        meta.write_text("{not json")
    elif damage == "foreign_key":
        info = json.loads(meta.read_text())
        info["key"] = "'other'"
        meta.write_text(json.dumps(info))
    else:
        st.load = lambda p: (_ for _ in ()).throw(OSError("undefined symbol"))
    with pytest.warns(RuntimeWarning, match="rebuilding it"):
        assert st.get_or_build("key", lambda: "rebuilt") == "rebuilt"
    if damage != "load_fails":
        assert loaded == []  # the damaged object was never handed to the loader
    st.load = real_load
    assert st.get_or_build("key", lambda: "again") == "rebuilt"  # the rebuilt entry is valid


def test_two_processes_building_one_key_build_it_once(tmp_path):
    # _compile.py imports only the standard library at module level: load it standalone.
    script = textwrap.dedent(f"""
        import importlib.util, pickle, sys, time
        from pathlib import Path
        spec = importlib.util.spec_from_file_location("c", {str(ROOT / "mla_kernels" / "_compile.py")!r})
        c = importlib.util.module_from_spec(spec); spec.loader.exec_module(c)
        st = c.DiskStore(Path(sys.argv[1]), fingerprint="f" * 40,
                         export=lambda o, p: Path(p).write_bytes(pickle.dumps(o)),
                         load=lambda p: pickle.loads(Path(p).read_bytes()), link=False)
        def build():
            with open(Path(sys.argv[1]) / "builds.txt", "a") as f:
                f.write(sys.argv[2] + "\\n")
            time.sleep(1.0)
            return "built by " + sys.argv[2]
        while time.time() < float(sys.argv[3]):
            time.sleep(0.005)
        print(st.get_or_build(("same", "key"), build))
    """)
    start = time.time() + 1.5
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(i), str(start)],
                              stdout=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    builds = (tmp_path / "builds.txt").read_text().split()
    assert len(builds) == 1, builds
    assert outs[0] == outs[1] == f"built by {builds[0]}"


def test_lock_timeout_compiles_without_storing(tmp_path):
    st = _pickle_store(tmp_path, lock_timeout=0.2)
    st.dir.mkdir(parents=True)
    import fcntl

    with open(st.paths("k")[2], "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        assert st.get_or_build("k", lambda: "mine") == "mine"
    assert not st.paths("k")[0].exists()


def test_cache_dir_and_switch(monkeypatch, tmp_path):
    monkeypatch.delenv(_compile.ENV_CACHE_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _compile.cache_dir() == tmp_path / "mla_kernels"
    monkeypatch.setenv(_compile.ENV_CACHE_DIR, str(tmp_path / "x"))
    assert _compile.cache_dir() == tmp_path / "x"
    monkeypatch.setenv(_compile.ENV_CACHE, "0")
    assert _compile.cache_dir() is None and _compile.disk_store() is None


def test_fingerprint_follows_sources_and_names_the_toolchain(monkeypatch):
    fp = _compile.toolchain_fingerprint()
    assert len(fp) == 64 and len(_compile.sources_hash()) == 64
    try:
        _compile.toolchain_fingerprint.cache_clear()
        monkeypatch.setattr(_compile, "sources_hash", lambda: "edited kernel")
        assert _compile.toolchain_fingerprint() != fp
    finally:
        _compile.toolchain_fingerprint.cache_clear()
    monkeypatch.undo()
    assert _compile.toolchain_fingerprint() == fp
    names = set(_compile.KERNEL_SOURCES)
    assert {"sm90", "sm100", "common"} <= names


def test_real_kernel_round_trip_through_export_and_load(monkeypatch, tmp_path):
    pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl is not installed")
    if _compile.find_linker() is None:
        pytest.skip("no C compiler: entries are object files only (covered by the stub tests)")
    from mla_kernels.common.probe import compile_probe

    monkeypatch.setenv(_compile.ENV_CACHE_DIR, str(tmp_path))
    key = ("test_probe_round_trip", "sm_90a")
    before = dict(_compile.cache_info())
    try:
        _, first = _compile.cached_compile(key, lambda: compile_probe("sm_90a"))
        after_cold = _compile.cache_info()
        assert after_cold["compiled"] == before["compiled"] + 1 and after_cold["stored"] == before["stored"] + 1
        assert after_cold["linked"] == before["linked"] + 1
        objs, libs = list(tmp_path.rglob("*.o")), list(tmp_path.rglob("*.so"))
        assert len(objs) == 1 and objs[0].stat().st_size > 1000 and len(libs) == 1
        assert len(list(tmp_path.rglob("*.manifest.json"))) == 1
        _compile.clear_cache()
        t0 = time.perf_counter()
        kinfo, second = _compile.cached_compile(key, lambda: pytest.fail("build() ran on a warm key"))
        load_s = time.perf_counter() - t0
        after_warm = _compile.cache_info()
        assert after_warm["compiled"] == after_cold["compiled"]  # loaded, not compiled
        assert after_warm["warm"] == after_cold["warm"] + 1
        assert after_warm["loaded_native"] == after_cold["loaded_native"] + 1
        import tvm_ffi

        assert isinstance(second, tvm_ffi.Function) and isinstance(kinfo, _compile.KernelInfo) and load_s < 5
        # a corrupted library is rebuilt (compiled again), never loaded.  The damaged copy is a new
        # file renamed over it: writing into the library this process has mapped would corrupt
        # the loaded code itself (and crash the interpreter at exit)
        bad = libs[0].with_suffix(".bad")
        bad.write_bytes(libs[0].read_bytes()[:-64] + b"\0" * 64)
        os.replace(bad, libs[0])
        _compile.clear_cache()
        with pytest.warns(RuntimeWarning, match="does not match its recorded SHA-256"):
            _compile.cached_compile(key, lambda: compile_probe("sm_90a"))
        assert _compile.cache_info()["compiled"] == after_warm["compiled"] + 1
        libs2 = list(tmp_path.rglob("*.so"))  # the rebuilt library (same name when the link is reproducible)
        info = json.loads(next(m for m in tmp_path.rglob("*.json") if not m.name.endswith("manifest.json")).read_text())
        import hashlib

        assert len(libs2) == 1 and hashlib.sha256(libs2[0].read_bytes()).hexdigest() == info["so_sha256"]
        # compile_report-style compiles (artifacts wanted) never touch the store
        n = len(list(tmp_path.rglob("*.json")))
        _compile.cached_compile(key + ("keep",), lambda: compile_probe("sm_90a", keep=True, dump_dir=str(tmp_path / "dump")))
        assert len(list(tmp_path.rglob("*.json"))) == n
    finally:
        _compile.clear_cache()


_WARM_CHILD = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import torch
    t1 = time.perf_counter()
    import mla_kernels
    from mla_kernels import _compile
    t2 = time.perf_counter()
    res = _compile.cached_compile(tuple(json.loads(sys.argv[1])), lambda: sys.exit("build() ran"))
    t3 = time.perf_counter()
    try:
        res[1](torch.ones(128), torch.zeros(128))  # CPU tensors: refused by the kernel's own checks
        called = "no error"
    except Exception as e:
        called = str(e)
    print("RESULT " + json.dumps(dict(
        torch_s=t1 - t0, mla_kernels_s=t2 - t1, warm_load_s=t3 - t2, kernel=repr(res[0]), called=called,
        smem=getattr(res[0], "smem_bytes", None), phases=_compile.first_call_phases(), **_compile.cache_info(),
        dsl=sorted(m for m in sys.modules if m == "cutlass" or m.startswith("cutlass.")),
        kernel_modules=sorted(m for m in sys.modules if m.startswith(("mla_kernels.sm90.", "mla_kernels.sm100."))
                              and not m.endswith("indexer_host")) + [m for m in sys.modules if m.endswith("probe")])))
""")


def test_warm_process_loads_without_importing_the_dsl(monkeypatch, tmp_path):
    """A fresh process loads a cached configuration from its manifest and shared library: no
    ``cutlass`` (nor kernel module) import, ``build()`` never runs, host attributes come back."""
    pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl is not installed")
    if _compile.find_linker() is None:
        pytest.skip("no C compiler to link the cached object into a shared library")
    from mla_kernels.common.probe import compile_probe

    monkeypatch.setenv(_compile.ENV_CACHE_DIR, str(tmp_path))
    key = ("test_warm_child", "sm_90a")
    try:
        _compile.cached_compile(key, lambda: compile_probe("sm_90a"), host_attrs=("smem_bytes",))
    finally:
        _compile.clear_cache()
    env = dict(os.environ, MLA_KERNELS_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", _WARM_CHILD, json.dumps(list(key))], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
    print(f"\nwarm child: {res}")
    assert res["dsl"] == [] and res["kernel_modules"] == []
    assert res["compiled"] == 0 and res["warm"] == 1 and res["loaded_native"] == 1
    assert res["kernel"] == "KernelInfo(PipelineProbe)" and res["smem"] == 528
    assert "cuda" in res["called"]  # the loaded host code ran its argument checks (expects CUDA tensors)
    assert res["warm_load_s"] < 2.0


def _stub_store(root):
    """A store whose "objects" are pickles, "linking" copies them and "native" loading unpickles."""
    import pickle
    import shutil

    return _compile.DiskStore(root, fingerprint="s" * 40,
                              export=lambda o, p: Path(p).write_bytes(pickle.dumps(o)),
                              load=lambda p: ("dsl", pickle.loads(Path(p).read_bytes())),
                              link=lambda o, so: shutil.copyfile(o, so),
                              load_native=lambda p: ("native", pickle.loads(Path(p).read_bytes())))


class _FakeKernel:
    ws_row_heads = 64  # a class attribute, read through getattr like the host code does

    def __init__(self):
        import torch

        self.det_ws_dtype = torch.bfloat16
        self.ws_col_perm = (1, 0, 3, 2)
        self.unrelated = object()  # not named in host_attrs: not kept


def test_manifest_serves_a_warm_key_without_build(monkeypatch, tmp_path):
    import torch

    st = _stub_store(tmp_path)
    monkeypatch.setattr(_compile, "disk_store", lambda: st)
    builds = []

    def build():
        builds.append(1)
        k = _FakeKernel()
        return k, _compile._through_store("opts-a", lambda: {"fn": "a"})

    attrs = ("ws_row_heads", "det_ws_dtype", "ws_col_perm", "absent")
    key = ("fake", 1)
    try:
        k, fn = _compile.cached_compile(key, build, host_attrs=attrs)
        assert builds == [1] and isinstance(k, _FakeKernel) and fn == {"fn": "a"}
        assert st.manifest_path(key).exists()
        _compile.clear_cache()
        k2, fn2 = _compile.cached_compile(key, build, host_attrs=attrs)
        assert builds == [1] and fn2 == ("native", {"fn": "a"})
        assert isinstance(k2, _compile.KernelInfo) and k2.kernel_class == "_FakeKernel"
        assert (k2.ws_row_heads, k2.det_ws_dtype, k2.ws_col_perm) == (64, torch.bfloat16, (1, 0, 3, 2))
        assert not hasattr(k2, "unrelated") and getattr(k2, "absent", "dflt") == "dflt"
        # a corrupt library: the warm path declines, build() runs, the store rebuilds the entry
        so = next(tmp_path.rglob("*.so"))
        so.write_bytes(b"garbage")
        _compile.clear_cache()
        with pytest.warns(RuntimeWarning, match="does not match its recorded SHA-256"):
            _, fn3 = _compile.cached_compile(key, build, host_attrs=attrs)
        assert builds == [1, 1] and fn3 == {"fn": "a"}
        # a manifest of another key (or unreadable) is ignored: build() runs and loads the entry
        st.manifest_path(key).write_text(json.dumps({"key": "('other',)", "entries": [], "result": {"v": 0}}))
        _compile.clear_cache()
        _, fn4 = _compile.cached_compile(key, build, host_attrs=attrs)
        assert builds == [1, 1, 1] and fn4 == ("native", {"fn": "a"})
        assert json.loads(st.manifest_path(key).read_text())["key"] == repr(key)  # rewritten
    finally:
        _compile.clear_cache()


def test_no_manifest_when_a_compile_bypasses_the_store_or_has_no_library(monkeypatch, tmp_path):
    st = _stub_store(tmp_path)
    monkeypatch.setattr(_compile, "disk_store", lambda: st)
    try:
        _compile.cached_compile(("mixed",), lambda: (_compile._through_store("a", lambda: 1),
                                                     _compile._through_store("b", lambda: 2, storable=False)))
        assert not st.manifest_path(("mixed",)).exists()
        st.link = False  # object files only (no C compiler): a warm process would need the DSL
        _compile.cached_compile(("objects",), lambda: _compile._through_store("a", lambda: 3))
        assert not st.manifest_path(("objects",)).exists()
        _compile.clear_cache()
        assert _compile.cached_compile(("objects",), lambda: _compile._through_store("a", lambda: 4)) == ("dsl", 3)
    finally:
        _compile.clear_cache()


def test_link_failure_keeps_the_object_file(tmp_path):
    st = _stub_store(tmp_path)
    st.link = lambda o, so: (_ for _ in ()).throw(RuntimeError("ld: cannot find -lcute_dsl_runtime"))
    _compile._warned.discard("link")
    with pytest.warns(RuntimeWarning, match="object files only"):
        assert st.get_or_build("k", lambda: "v") == "v"
    assert st.load_entry("k") == (("dsl", "v"), None)
    assert st.load_entry("k", native_only=True) == (None, None)


def test_fingerprint_imports_nothing():
    script = ("import sys; from mla_kernels import _compile; _compile.toolchain_fingerprint(); "
              "_compile.dsl_available(); print(sorted(m for m in sys.modules if m.split('.')[0] in ('cutlass', 'tvm_ffi')))")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"


def test_indexer_host_max_topk_matches_the_kernel():
    pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl is not installed")
    from mla_kernels.sm90 import indexer_host, indexer_loss_fwd

    assert indexer_host.MAX_TOPK == indexer_loss_fwd.MAX_TOPK


_FIRST_CALL = textwrap.dedent("""
    import json, os, sys, time
    op = sys.argv[1]
    t0 = time.perf_counter()
    import torch
    t1 = time.perf_counter()
    import mla_kernels as mk
    from mla_kernels import _compile
    t_import = time.perf_counter() - t1
    torch.cuda.init()
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(64, 128, 576, generator=g) * 0.1).to("cuda", torch.bfloat16)
    kv = (torch.randn(4096, 1, 576, generator=g) * 0.1).to("cuda", torch.bfloat16)
    idx = torch.randint(0, 4096, (64, 1, 2048), generator=g).to("cuda", torch.int32)
    dout = (torch.randn(64, 128, 512, generator=g) * 0.1).to("cuda", torch.bfloat16)
    kc = kv.view(64, 64, 1, 576)  # the decode's paged cache: 64 pages of 64 rows
    torch.cuda.synchronize()
    phases_before = _compile.first_call_phases()
    if op == "bwd":  # the forward first (its own first call, warm or cold), then time the backward's
        out, _, lse = mk.sparse_mla_fwd(q, kv, idx, 576 ** -0.5)
        torch.cuda.synchronize()
        phases_before = _compile.first_call_phases()

    def call():
        if op == "fwd":
            return mk.sparse_mla_fwd(q, kv, idx, 576 ** -0.5)[0]
        if op == "bwd":
            return mk.sparse_mla_bwd(q, kv, out, dout, idx, lse, 576 ** -0.5)[0]
        return mk.sparse_mla_decode(q.view(64, 1, 128, 576), kc, idx.view(64, 1, 2048), 576 ** -0.5)[0]

    t0 = time.perf_counter()
    res = call()
    torch.cuda.synchronize()
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    res2 = call()
    torch.cuda.synchronize()
    t_second = time.perf_counter() - t0
    print("RESULT " + json.dumps(dict(op=op, import_s=t_import,
                                      first_call_s=t_first, second_call_s=t_second,
                                      checksum=res.float().sum().item(), equal=bool(torch.equal(res, res2)),
                                      dsl_imported="cutlass" in sys.modules,
                                      kernel_modules=sorted(m for m in sys.modules if m.startswith(
                                          ("mla_kernels.sm90.", "mla_kernels.sm100.")) and not m.endswith("_host")),
                                      phases_before=phases_before,
                                      phases=_compile.first_call_phases(), **_compile.cache_info())))
""")


def _first_call(cache: Path, op: str = "fwd"):
    env = dict(os.environ, MLA_KERNELS_CACHE_DIR=str(cache), MLA_KERNELS_BACKEND="sm90")
    r = subprocess.run([sys.executable, "-c", _FIRST_CALL, op], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@skip_unless_sm90()
@pytest.mark.parametrize("op", ["fwd", "bwd", "decode"])
def test_second_process_loads_the_compiled_kernel_from_disk(tmp_path, op):
    cold = _first_call(tmp_path, op)
    warm = _first_call(tmp_path, op)
    warm2 = _first_call(tmp_path, op)
    print(f"\n{op} first call, cold cache: {cold['first_call_s']:.3f} s; warm: {warm['first_call_s']:.3f} s, "
          f"{warm2['first_call_s']:.3f} s (import mla_kernels {warm['import_s']:.3f} s; second call "
          f"{warm['second_call_s'] * 1e3:.2f} ms; DSL imported: cold {cold['dsl_imported']}, warm "
          f"{warm['dsl_imported']})\nphases cold {cold['phases']}\nphases warm {warm['phases']} "
          f"(before the timed call: {warm['phases_before']})\nwarm stats {warm}")
    assert cold["compiled"] >= 1 and cold["stored"] >= 1
    assert warm["compiled"] == 0 and warm["loaded"] >= 1 and warm2["compiled"] == 0
    assert warm["checksum"] == cold["checksum"] and warm["equal"]
    assert warm["first_call_s"] < cold["first_call_s"]
    if cold["linked"]:  # a C compiler was there: the warm process never imports the DSL
        assert warm["warm"] >= 1 and not warm["dsl_imported"] and warm["kernel_modules"] == []
