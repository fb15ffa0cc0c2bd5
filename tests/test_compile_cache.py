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
                         load=lambda p: pickle.loads(Path(p).read_bytes()))
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
    from mla_kernels.common.probe import compile_probe

    monkeypatch.setenv(_compile.ENV_CACHE_DIR, str(tmp_path))
    key = ("test_probe_round_trip", "sm_90a")
    before = dict(_compile.cache_info())
    try:
        _, first = _compile.cached_compile(key, lambda: compile_probe("sm_90a"))
        after_cold = _compile.cache_info()
        assert after_cold["compiled"] == before["compiled"] + 1 and after_cold["stored"] == before["stored"] + 1
        objs = list(tmp_path.rglob("*.o"))
        assert len(objs) == 1 and objs[0].stat().st_size > 1000
        _compile.clear_cache()
        t0 = time.perf_counter()
        _, second = _compile.cached_compile(key, lambda: compile_probe("sm_90a"))
        load_s = time.perf_counter() - t0
        after_warm = _compile.cache_info()
        assert after_warm["compiled"] == after_cold["compiled"]  # loaded, not compiled
        assert after_warm["loaded"] == after_cold["loaded"] + 1
        import tvm_ffi

        assert isinstance(second, tvm_ffi.Function) and load_s < 5
        # a corrupted object file is rebuilt (compiled again), not loaded
        objs[0].write_bytes(objs[0].read_bytes()[:-64] + b"\0" * 64)
        _compile.clear_cache()
        with pytest.warns(RuntimeWarning, match="does not match its recorded SHA-256"):
            _compile.cached_compile(key, lambda: compile_probe("sm_90a"))
        assert _compile.cache_info()["compiled"] == after_warm["compiled"] + 1
        # compile_report-style compiles (artifacts wanted) never touch the store
        n = len(list(tmp_path.rglob("*.json")))
        _compile.cached_compile(key + ("keep",), lambda: compile_probe("sm_90a", keep=True, dump_dir=str(tmp_path / "dump")))
        assert len(list(tmp_path.rglob("*.json"))) == n
    finally:
        _compile.clear_cache()


_FIRST_CALL = textwrap.dedent("""
    import json, os, sys, time
    import torch
    t0 = time.perf_counter()
    import mla_kernels as mk
    from mla_kernels import _compile
    t_import = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(64, 128, 576, generator=g) * 0.1).to("cuda", torch.bfloat16)
    kv = (torch.randn(4096, 1, 576, generator=g) * 0.1).to("cuda", torch.bfloat16)
    idx = torch.randint(0, 4096, (64, 1, 2048), generator=g).to("cuda", torch.int32)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out, _, lse = mk.sparse_mla_fwd(q, kv, idx, 576 ** -0.5)
    torch.cuda.synchronize()
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out2, _, _ = mk.sparse_mla_fwd(q, kv, idx, 576 ** -0.5)
    torch.cuda.synchronize()
    t_second = time.perf_counter() - t0
    print("RESULT " + json.dumps(dict(import_s=t_import, first_call_s=t_first, second_call_s=t_second,
                                      checksum=out.float().sum().item(), equal=bool(torch.equal(out, out2)),
                                      phases=_compile.first_call_phases(), **_compile.cache_info())))
""")


def _first_call(cache: Path):
    env = dict(os.environ, MLA_KERNELS_CACHE_DIR=str(cache), MLA_KERNELS_BACKEND="sm90")
    r = subprocess.run([sys.executable, "-c", _FIRST_CALL], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@skip_unless_sm90()
def test_second_process_loads_the_compiled_kernel_from_disk(tmp_path):
    cold = _first_call(tmp_path)
    warm = _first_call(tmp_path)
    warm2 = _first_call(tmp_path)
    print(f"\nfirst call, cold cache: {cold['first_call_s']:.3f} s; warm: {warm['first_call_s']:.3f} s, "
          f"{warm2['first_call_s']:.3f} s (import {warm['import_s']:.2f} s; second call "
          f"{warm['second_call_s'] * 1e3:.2f} ms)\nphases cold {cold['phases']}\nphases warm {warm['phases']}")
    assert cold["compiled"] >= 1 and cold["stored"] >= 1
    assert warm["compiled"] == 0 and warm["loaded"] >= 1 and warm2["compiled"] == 0
    assert warm["checksum"] == cold["checksum"] and warm["equal"]
    assert warm["first_call_s"] < cold["first_call_s"]
