"""One compile cache for every kernel: in memory per process, and on disk across processes.

In memory: ``(kernel class, static config, dtypes, arch)`` -> compiled function
(:func:`cached_compile`).  A kernel is compiled once per key with fake tensors whose varying
extents (``s_q``, ``s_kv``, ``topk``) are symbolic (``cute.sym_int``), and with
``--enable-tvm-ffi`` so that a call passes torch tensors directly and a new size never
recompiles.  The target arch comes from the device, or is given explicitly (compile-only on a
machine without a GPU, e.g. ``tools/compile_report.py``).

On disk (:class:`DiskStore`): a compile made inside :func:`cached_compile` is exported with the
DSL's ``export_to_c`` (one object file: host code + embedded cubin) and linked once, at store
time, into a shared library against the DSL runtime and TVM-FFI (``cc -shared``, the link line of
``cutlass.cute.export.aot_config``).  A later process loads that library with ``tvm_ffi`` alone:

* **the warm path imports no CuTe DSL.**  :func:`cached_compile` first reads the key's manifest
  (``<m>.manifest.json``: the store entries its ``build()`` compiled, and what ``build()``
  returned -- the compiled functions and the few plain attributes of the kernel object that
  host code reads, ``host_attrs``), checks each library's SHA-256 and ``dlopen``s it through
  ``tvm_ffi.load_module``; ``build()`` (which imports the kernel class, hence ``cutlass``) does not
  run.  The grid, the shared-memory size and the argument order live in the compiled host
  function itself, so nothing else is needed to launch;
* without a C compiler at store time (or ``MLA_KERNELS_CACHE_LINK=0``) an entry has only its
  object file, which loads through ``cute.runtime.load_module(..., enable_tvm_ffi=True)``
  (importing the DSL, ~0.5-2.5 s) -- still no compile.

* Location: ``$MLA_KERNELS_CACHE_DIR``, default ``$XDG_CACHE_HOME/mla_kernels`` (``~/.cache/...``);
  ``MLA_KERNELS_CACHE=0`` turns the on-disk store off (memory only).
* Key: the in-memory key, the compile options, the call's position in the build, and a
  fingerprint directory of everything else a compiled kernel depends on: the CuTe DSL, its libs
  wheels (the cu12 and cu13 toolchains emit different code) and TVM-FFI versions and locations
  (read from package metadata: the DSL is not imported), the Python version, and a hash of the
  package's kernel sources (``common/``, ``sm90/``, ``sm100/``, ``tma.py``, this file).  Editing a
  kernel file therefore starts a fresh directory.
* Concurrency: the build of one key runs under an exclusive ``fcntl`` lock on
  ``<key>.lock``; a second process waiting on it finds the entry on disk and loads it.  Files are
  written to a temporary name and renamed (atomic): the object, the library, then the metadata;
  the manifest last.
* Integrity: ``<key>.json`` records the object's and the library's SHA-256 and size; an entry
  whose file does not match, or that fails to load, is deleted and rebuilt (never loaded), with
  one warning.  A library's name carries its hash, so a rebuilt entry is never confused with one
  a process has already ``dlopen``ed.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

__all__ = [
    "arch_for_capability", "arch_for_device", "compile_kernel", "cached_compile", "cache_info", "clear_cache",
    "cache_dir", "disk_store", "DiskStore", "KernelInfo", "find_linker", "toolchain_fingerprint", "dsl_available",
    "ENV_CACHE_DIR", "ENV_CACHE", "ENV_LINK",
]

ENV_CACHE_DIR = "MLA_KERNELS_CACHE_DIR"
ENV_CACHE = "MLA_KERNELS_CACHE"
#: ``0``: store object files only (no shared library; a warm load then imports the DSL).
ENV_LINK = "MLA_KERNELS_CACHE_LINK"
#: Seconds a process waits for another one building the same key before it compiles on its own
#: (without storing the result).
LOCK_TIMEOUT_S = 900.0
_FORMAT = "v2"

_cache: Dict[Tuple, Any] = {}
_lock = threading.Lock()
#: Set by :func:`cached_compile` while its ``build()`` runs: the key under which
#: :func:`compile_kernel` stores (and looks up) its result on disk, a call counter, and the
#: entries it went through (``[(repr(store key), function, native)]``, or None once one compile
#: bypassed the store: no manifest then).
_persist: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("mla_kernels_persist", default=None)
_stats = {"compiled": 0, "loaded": 0, "loaded_native": 0, "warm": 0, "stored": 0, "linked": 0, "rebuilt": 0}
#: Seconds spent per phase of the process's compile-cache misses (``first_call_phases()``).
_phases: Dict[str, float] = {}


@contextlib.contextmanager
def _phase(name: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _phases[name] = _phases.get(name, 0.0) + time.perf_counter() - t0


def first_call_phases() -> Dict[str, float]:
    """Seconds this process spent importing the DSL, fingerprinting, compiling, exporting and
    loading kernels (where a first call's time goes)."""
    return {k: round(v, 4) for k, v in _phases.items()}


def dsl_available() -> Optional[str]:
    """None when the CuTe DSL and TVM-FFI are installed, else why not -- found, not imported
    (importing the DSL takes seconds; a warm process never needs it)."""
    for name, dist in (("cutlass", "nvidia-cutlass-dsl"), ("tvm_ffi", "apache-tvm-ffi")):
        if _package_dir(name) == "unavailable":
            return f"{dist} is not installed (no importable {name!r})"
    return None


def arch_for_capability(major: int, minor: int) -> str:
    """``(9, 0) -> "sm_90a"``, ``(10, 0) -> "sm_100a"``, ``(10, 3) -> "sm_103a"``."""
    if (major, minor) == (9, 0):
        return "sm_90a"
    if major == 10:
        return f"sm_10{minor}a"
    raise ValueError(f"no CuTe DSL kernels for compute capability {major}.{minor}")


_CAPABILITIES: dict = {}


def device_capability(device) -> tuple:
    """``(major, minor)`` of CUDA ``device``, queried once per device: the query costs host time
    (microseconds) on every call's path, and a device's capability does not change in a process."""
    import torch

    device = torch.device(device)
    key = device.index if device.index is not None else torch.cuda.current_device()
    cap = _CAPABILITIES.get(key)
    if cap is None:
        cap = _CAPABILITIES[key] = tuple(torch.cuda.get_device_capability(key))
    return cap


def arch_for_device(device) -> str:
    major, minor = device_capability(device)
    return arch_for_capability(major, minor)


def compile_kernel(
    fn: Callable,
    *args: Any,
    arch: str,
    tvm_ffi: bool = True,
    keep: bool = False,
    dump_dir: Optional[str] = None,
    extra_options: str = "",
):
    """``cute.compile(fn, *args)`` for ``arch`` (``sm_90a``, ``sm_100a``, ``sm_103a``).

    ``keep`` keeps PTX and CUBIN in ``compiled.artifacts`` (and writes them to ``dump_dir``).
    Called inside :func:`cached_compile`'s ``build`` (and with none of ``keep``/``dump_dir``/
    ``extra_options``, which ask for a real compile's artifacts), the result goes through the
    on-disk store: loaded from it when present, else compiled and stored.
    """
    opts = [f"--gpu-arch {arch}"]
    if tvm_ffi:
        opts.append("--enable-tvm-ffi")
    if keep:
        opts.append("--keep-ptx --keep-cubin")
        if dump_dir:
            os.makedirs(dump_dir, exist_ok=True)
            opts.append(f"--dump-dir {dump_dir}")
    if extra_options:
        opts.append(extra_options)
    options = " ".join(opts)

    def compile_now():
        with _phase("import_dsl"):
            import cutlass.cute as cute
        _stats["compiled"] += 1
        with _phase("compile"):
            return cute.compile(fn, *args, options=options)

    return _through_store(options, compile_now, tvm_ffi and not (keep or dump_dir or extra_options))


def _through_store(options: str, compile_now: Callable[[], Any], storable: bool = True):
    """``compile_now()``, through the on-disk store when called inside :func:`cached_compile`'s
    ``build`` (and ``storable``), recording the entry for the key's manifest."""
    scope = _persist.get()
    store = disk_store() if scope is not None and storable else None
    if store is None:
        if scope is not None:
            scope[2] = None  # a compile outside the store: this build gets no manifest
        return compile_now()
    scope[1] += 1
    skey = (scope[0], scope[1], options)
    fn = store.get_or_build(skey, compile_now)
    if scope[2] is not None:
        scope[2].append((repr(skey), fn))
    return fn


def cached_compile(key: Tuple, build: Callable[[], Any], host_attrs: Tuple[str, ...] = ()):
    """Return what ``build()`` returned for ``key``, building it once per process.

    ``build`` typically constructs a kernel object and calls :func:`compile_kernel` (returning
    ``(kernel, compiled)``); those compiles go through the on-disk store under ``key``.  ``key``
    must be a tuple of plain values (str, int, bool, None) that names the static configuration
    completely.

    A later process gets the same structure back from the store's manifest without running
    ``build`` (no DSL import): each compiled function is loaded from its shared library and any
    other object in the result (the kernel) is replaced by a :class:`KernelInfo` holding the
    attributes named in ``host_attrs`` (plain values, tuples of them, torch dtypes) -- the
    caller names every attribute its host code reads."""
    fn = _cache.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _cache.get(key)
        if fn is None:
            fn = _warm_load(key)
            if fn is None:
                scope = [key, 0, []]
                token = _persist.set(scope)
                try:
                    fn = build()
                finally:
                    _persist.reset(token)
                if scope[2]:
                    _write_manifest(key, scope[2], fn, host_attrs)
            _cache[key] = fn
    return fn


# ---------------------------------------------------------------------------------------------
# Manifests: what a cached_compile key's build() returned, loadable without running it
# ---------------------------------------------------------------------------------------------


class KernelInfo:
    """Stands in for a kernel object in a result loaded from a manifest: the attributes the
    host code reads (``host_attrs``), nothing else."""

    def __init__(self, cls: str, attrs: Dict[str, Any]):
        self.kernel_class = cls
        self.__dict__.update(attrs)

    def __repr__(self) -> str:
        return f"KernelInfo({self.kernel_class})"


_PLAIN = (type(None), bool, int, float, str)


def _encode_value(v):
    """JSON form of a host attribute (None when it cannot be stored)."""
    if isinstance(v, _PLAIN):
        return {"v": v}
    if isinstance(v, (tuple, list)) and all(isinstance(x, _PLAIN) for x in v):
        return {"seq": list(v), "tuple": isinstance(v, tuple)}
    if type(v).__name__ == "dtype" and type(v).__module__ == "torch":
        return {"torch_dtype": str(v).split(".", 1)[1]}
    return None


def _decode_value(e):
    if "v" in e:
        return e["v"]
    if "seq" in e:
        return tuple(e["seq"]) if e["tuple"] else list(e["seq"])
    import torch

    dt = getattr(torch, e["torch_dtype"])
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"not a torch dtype: {e['torch_dtype']}")
    return dt


def _encode_result(obj, compiled: Dict[int, int], host_attrs):
    """JSON form of ``build()``'s result; ``compiled`` maps ``id(fn)`` to its entry's position.
    Raises ValueError for what a manifest cannot describe."""
    if id(obj) in compiled:
        return {"entry": compiled[id(obj)]}
    if isinstance(obj, _PLAIN):
        return {"v": obj}
    if isinstance(obj, tuple):
        return {"tuple": [_encode_result(x, compiled, host_attrs) for x in obj]}
    if isinstance(obj, (list, dict, set)):
        raise ValueError(f"a {type(obj).__name__} in a build result")
    attrs = {}
    for name in host_attrs:
        if hasattr(obj, name):
            e = _encode_value(getattr(obj, name))
            if e is None:
                raise ValueError(f"host attribute {name}={getattr(obj, name)!r} cannot be stored")
            attrs[name] = e
    return {"kernel": type(obj).__qualname__, "attrs": attrs}


def _decode_result(e, fns):
    if "entry" in e:
        return fns[e["entry"]]
    if "v" in e:
        return e["v"]
    if "tuple" in e:
        return tuple(_decode_result(x, fns) for x in e["tuple"])
    return KernelInfo(e["kernel"], {k: _decode_value(v) for k, v in e["attrs"].items()})


def _write_manifest(key, entries, result, host_attrs) -> None:
    """Record ``key``'s store entries and result shape once every entry has a shared library
    (an entry without one would need the DSL to load, so the warm path could not serve it)."""
    store = disk_store()
    if store is None:
        return
    try:
        if not all(store.has_library(KeyRepr(rk)) for rk, _ in entries):
            return
        compiled = {id(fn): i for i, (_, fn) in enumerate(entries)}
        info = dict(key=repr(key), entries=[rk for rk, _ in entries],
                    result=_encode_result(result, compiled, host_attrs))
        _atomic_write(store.manifest_path(key), json.dumps(info, indent=1).encode())
    except (OSError, ValueError) as e:
        _warn(f"mla_kernels: no compile cache manifest for {key!r} ({type(e).__name__}: {e}); "
              "a later process loads it through the DSL")


def _warm_load(key):
    """``build()``'s result for ``key`` from the store's manifest and shared libraries (no DSL
    import), or None when that is not possible (no store, no manifest, an entry absent,
    without a library or not matching its hash): the caller then runs ``build()``, whose
    store lookups rebuild a corrupt entry."""
    store = disk_store()
    if store is None:
        return None
    with _phase("manifest"):
        path = store.manifest_path(key)
        try:
            info = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return None
        if not isinstance(info, dict) or info.get("key") != repr(key):
            return None
    fns = []
    for rk in info.get("entries", []):
        fn, _ = store.load_entry(KeyRepr(rk), native_only=True)
        if fn is None:
            return None
        fns.append(fn)
    try:
        res = _decode_result(info["result"], fns)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        return None
    _stats["warm"] += 1
    return res


def cache_info() -> Dict[str, Any]:
    """Entries in memory, and this process's compiles / disk loads / stores / rebuilt entries."""
    return {"entries": len(_cache), **_stats}


def clear_cache() -> None:
    """Forget the in-memory cache (the on-disk store stays)."""
    with _lock:
        _cache.clear()


# ---------------------------------------------------------------------------------------------
# The on-disk store
# ---------------------------------------------------------------------------------------------


def cache_dir() -> Optional[Path]:
    """The on-disk cache root, or None when ``MLA_KERNELS_CACHE=0``."""
    if os.environ.get(ENV_CACHE, "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    d = os.environ.get(ENV_CACHE_DIR, "").strip()
    if d:
        return Path(d).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mla_kernels"


#: Sources a compiled kernel depends on (relative to the package).
KERNEL_SOURCES = ("common", "sm90", "sm100", "tma.py", "_compile.py")


@functools.lru_cache(maxsize=None)
def sources_hash() -> str:
    """SHA-256 over the package's kernel sources (names and contents, in a fixed order)."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for item in KERNEL_SOURCES:
        p = root / item
        files = sorted(p.rglob("*.py")) if p.is_dir() else [p]
        for f in files:
            if f.is_file():
                data = f.read_bytes()
                h.update(f.relative_to(root).as_posix().encode() + b"\0" + len(data).to_bytes(8, "little"))
                h.update(data)
    return h.hexdigest()


#: Distributions whose versions a compiled kernel depends on (absent ones are recorded as such).
TOOLCHAIN_DISTS = ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
                   "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13", "apache-tvm-ffi")


def _package_dir(name: str) -> str:
    """Where top-level package ``name`` would be imported from (found, not imported)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return "unavailable"
    locs = list(spec.submodule_search_locations or [])
    return locs[0] if locs else str(spec.origin)


@functools.lru_cache(maxsize=None)
def toolchain_fingerprint() -> str:
    """What else a compiled kernel depends on: DSL / libs wheels / TVM-FFI versions and locations,
    the Python version and :func:`sources_hash`, as one hex digest (the store's directory name).
    Nothing is imported: versions come from the packages' metadata, locations from
    ``importlib.util.find_spec``."""
    import importlib.metadata as md
    import platform

    parts = [f"format={_FORMAT}", f"python={sys.version_info[0]}.{sys.version_info[1]}",
             f"machine={platform.machine()}", f"src={sources_hash()}",
             f"cutlass@{_package_dir('cutlass')}", f"tvm_ffi@{_package_dir('tvm_ffi')}"]
    for name in TOOLCHAIN_DISTS:
        try:
            parts.append(f"{name}={md.version(name)}")
        except Exception:
            parts.append(f"{name}=absent")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _dsl_export(compiled, path: str) -> None:
    compiled.export_to_c(path, function_name="mla_kernel")


def _runtime_libraries() -> list:
    """The shared libraries an exported object needs (the DSL runtime, TVM-FFI); the DSL is
    already imported when this runs (right after a compile)."""
    from cutlass.cute.runtime import find_runtime_libraries

    return [lib for lib in find_runtime_libraries(enable_tvm_ffi=True) if os.path.exists(lib)]


def find_linker() -> Optional[str]:
    """The C compiler driver used to link an exported object into a shared library: ``$CC``,
    else ``cc``, ``gcc`` or ``clang`` on the PATH; None when ``MLA_KERNELS_CACHE_LINK=0`` or none
    is found (entries then keep only their object file)."""
    if os.environ.get(ENV_LINK, "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    cc = os.environ.get("CC", "").strip()
    if cc:
        return shutil.which(cc.split()[0]) or None
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _dsl_link(obj: str, so: str) -> None:
    """``cc -shared -o so obj -L<dir> -l<lib> -Wl,-rpath,<dir>`` for each runtime library (the link
    line ``cutlass.cute.export.aot_config`` prints), so that ``dlopen`` finds them by itself."""
    cc = find_linker()
    if cc is None:
        raise FileNotFoundError("no C compiler to link with (set CC, or MLA_KERNELS_CACHE_LINK=0)")
    cmd = [cc, "-shared", "-o", so, obj]
    for lib in _runtime_libraries():
        d, name = os.path.split(os.path.realpath(lib))
        if not (name.startswith("lib") and ".so" in name):
            raise ValueError(f"unexpected runtime library name {lib}")
        cmd += [f"-L{d}", f"-l:{name}", f"-Wl,-rpath,{d}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {(r.stderr or r.stdout).strip()[-800:]}")


def _native_load(path: str):
    """Load a linked shared library with TVM-FFI alone (no DSL); returns its TVM-FFI function."""
    import tvm_ffi

    return tvm_ffi.load_module(path).mla_kernel


_runtime_preloaded = False


def _dsl_load(path: str):
    """Load an exported object file through the DSL (imports ``cutlass``); returns the TVM-FFI
    function (called like the compiled one)."""
    global _runtime_preloaded
    import ctypes

    with _phase("import_dsl"):
        import cutlass.cute as cute

    if not _runtime_preloaded:
        # The DSL runtime's symbols must be globally visible to the loaded object in a process
        # that has not compiled anything yet.
        for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
            if os.path.exists(lib):
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        _runtime_preloaded = True
    module = cute.runtime.load_module(path, enable_tvm_ffi=True)
    return module.mla_kernel


class _FileLock:
    """Exclusive ``fcntl.flock`` on a lock file, polled until ``timeout``; ``acquired`` says
    whether it was obtained (no fcntl, e.g. Windows: never)."""

    def __init__(self, path: Path, timeout: float):
        self.path, self.timeout, self.fd, self.acquired = path, timeout, None, False

    def __enter__(self):
        try:
            import fcntl
        except ImportError:  # pragma: no cover
            return self
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.acquired = True
                return self
            except OSError:
                if time.monotonic() >= deadline:
                    return self
                time.sleep(0.05)

    def __exit__(self, *exc):
        if self.fd is not None:
            if self.acquired:
                import fcntl

                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
        return False


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


class DiskStore:
    """Compiled kernels on disk under ``root/<fingerprint>/``: ``<h>.o`` (the exported object),
    ``<h>-<sha>.so`` (it linked into a shared library, when a C compiler is there),
    ``<h>.json`` (its key, the files' SHA-256 and sizes, creation time), ``<h>.lock``; ``h`` =
    SHA-256 of the key.  ``<m>.manifest.json`` per :func:`cached_compile` key.

    ``export(compiled, path)`` / ``link(obj, so)`` / ``load(path)`` / ``load_native(path)``
    default to the DSL's ``export_to_c``, ``cc -shared``, ``cute.runtime.load_module`` and
    ``tvm_ffi.load_module``; tests pass stand-ins to exercise locking and corruption without a
    GPU (``link=False``: object files only)."""

    def __init__(self, root: Path, fingerprint: Optional[str] = None, export=None, load=None,
                 lock_timeout: float = LOCK_TIMEOUT_S, link=None, load_native=None):
        self.dir = Path(root) / (fingerprint or toolchain_fingerprint())[:24]
        self.export = export or _dsl_export
        self.load = load or _dsl_load
        self.link = _dsl_link if link is None else link
        self.load_native = load_native or _native_load
        self.lock_timeout = lock_timeout

    @staticmethod
    def _h(rkey: str) -> str:
        return hashlib.sha256(rkey.encode()).hexdigest()[:32]

    def paths(self, key) -> Tuple[Path, Path, Path]:
        """``(object, metadata, lock)`` of ``key`` (or of ``repr(key)`` given as a :class:`KeyRepr`)."""
        h = self._h(_rkey(key))
        return self.dir / f"{h}.o", self.dir / f"{h}.json", self.dir / f"{h}.lock"

    def manifest_path(self, key) -> Path:
        return self.dir / f"{self._h('manifest:' + repr(key))}.manifest.json"

    def has_library(self, key) -> bool:
        try:
            return bool(json.loads(self.paths(key)[1].read_text()).get("so"))
        except (OSError, ValueError, AttributeError):
            return False

    @staticmethod
    def _verified(path: Path, sha: Optional[str], size: Optional[int]) -> bytes:
        data = path.read_bytes()
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha:
            raise _Mismatch(f"{path.name} does not match its recorded SHA-256")
        return data

    def load_entry(self, key, native_only: bool = False):
        """``(fn, None)`` for a valid entry, ``(None, None)`` when absent (or, with
        ``native_only``, when it has no shared library), ``(None, why)`` when the entry exists
        but is corrupt or fails to load.  The shared library is preferred (no DSL import)."""
        rkey = _rkey(key)
        obj, meta, _ = self.paths(key)
        try:
            info = json.loads(meta.read_text())
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError) as e:
            return None, f"unreadable ({type(e).__name__}: {e})"
        if not isinstance(info, dict) or info.get("key") != rkey:
            return None, "key mismatch (hash collision or foreign file)"
        so_name = info.get("so")
        if native_only and not so_name:
            return None, None
        try:
            if so_name:
                so = self.dir / so_name
                if so.parent != self.dir or not so.name.endswith(".so"):
                    return None, f"bad library name {so_name!r}"
                self._verified(so, info.get("so_sha256"), info.get("so_size"))
                with _phase("load"):
                    fn = self.load_native(str(so))
                _stats["loaded_native"] += 1
            else:
                self._verified(obj, info.get("sha256"), info.get("size"))
                with _phase("load"):
                    fn = self.load(str(obj))
        except _Mismatch as e:
            return None, f"{e}"
        except OSError as e:
            return None, f"unreadable ({type(e).__name__}: {e})"
        except Exception as e:
            return None, f"load failed ({type(e).__name__}: {e})"
        _stats["loaded"] += 1
        return fn, None


    def _remove(self, key) -> None:
        obj, meta, _ = self.paths(key)
        so = None
        with contextlib.suppress(OSError, ValueError, AttributeError):
            so = json.loads(meta.read_text()).get("so")
        for p in (meta, obj) + ((self.dir / so,) if so and "/" not in so else ()):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    def _store(self, key, compiled) -> None:
        obj, meta, _ = self.paths(key)
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{obj.name}.", suffix=".o")
        os.close(fd)
        tmp_so = tmp[:-2] + ".so"
        info = dict(key=repr(key))
        try:
            with _phase("export"):
                self.export(compiled, tmp)
            data = Path(tmp).read_bytes()
            info.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
            if self.link:
                try:
                    with _phase("link"):
                        self.link(tmp, tmp_so)
                    so_data = Path(tmp_so).read_bytes()
                    so_sha = hashlib.sha256(so_data).hexdigest()
                    so = self.dir / f"{obj.stem}-{so_sha[:16]}.so"
                    os.replace(tmp_so, so)
                    info.update(so=so.name, so_sha256=so_sha, so_size=len(so_data))
                    _stats["linked"] += 1
                except Exception as e:
                    _warn_once("link", f"mla_kernels: compiled kernels are cached as object files only "
                               f"({type(e).__name__}: {e}); a later process loads them through the CuTe DSL "
                               "(slower first call)")
            os.replace(tmp, obj)
        finally:
            for t in (tmp, tmp_so):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(t)
        info.update(created=time.strftime("%Y-%m-%dT%H:%M:%S"), pid=os.getpid())
        _atomic_write(meta, json.dumps(info, indent=1).encode())
        _stats["stored"] += 1

    def get_or_build(self, key, build: Callable[[], Any]):
        """The entry for ``key``: loaded if valid, else built (under the key's lock) and stored.
        Any failure of the store itself falls back to ``build()`` (a cache never breaks a call)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            _warn(f"mla_kernels: compile cache directory {self.dir} unusable ({e}); compiling in memory only")
            return build()
        fn, why = self.load_entry(key)
        if fn is not None:
            return fn
        _, _, lock = self.paths(key)
        with _FileLock(lock, self.lock_timeout) as lk:
            if lk.acquired:
                fn, why2 = self.load_entry(key)  # another process may have built it meanwhile
                if fn is not None:
                    return fn
                why = why or why2
                if why:
                    _stats["rebuilt"] += 1
                    _warn(f"mla_kernels: compile cache entry {self.paths(key)[0]} {why}; rebuilding it")
                    self._remove(key)
            compiled = build()
            if lk.acquired:
                try:
                    self._store(key, compiled)
                except Exception as e:
                    self._remove(key)
                    _warn(f"mla_kernels: could not store a compiled kernel in {self.dir} "
                          f"({type(e).__name__}: {e}); it stays in memory")
            return compiled


class _Mismatch(Exception):
    pass


class KeyRepr(str):
    """A store key given as its ``repr`` (as a manifest records it)."""


def _rkey(key) -> str:
    return str(key) if isinstance(key, KeyRepr) else repr(key)


_warned: set = set()


def _warn_once(tag: str, msg: str) -> None:
    if tag not in _warned:
        _warned.add(tag)
        _warn(msg)


def _warn(msg: str) -> None:
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


_stores: Dict[Tuple, DiskStore] = {}


def disk_store() -> Optional[DiskStore]:
    """The store for the current ``MLA_KERNELS_CACHE_DIR`` (None when turned off)."""
    root = cache_dir()
    if root is None:
        return None
    st = _stores.get((str(root),))
    if st is None:
        with _phase("fingerprint"):
            st = _stores[(str(root),)] = DiskStore(root)
    return st
