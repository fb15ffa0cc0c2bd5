"""One compile cache for every kernel: in memory per process, and on disk across processes.

In memory: ``(kernel class, static config, dtypes, arch)`` -> compiled function
(:func:`cached_compile`).  A kernel is compiled once per key with fake tensors whose varying
extents (``s_q``, ``s_kv``, ``topk``) are symbolic (``cute.sym_int``), and with
``--enable-tvm-ffi`` so that a call passes torch tensors directly and a new size never
recompiles.  The target arch comes from the device, or is given explicitly (compile-only on a
machine without a GPU, e.g. ``tools/compile_report.py``).

On disk (:class:`DiskStore`): a compile made inside :func:`cached_compile` is exported with the
DSL's ``export_to_c`` (one object file: host code + embedded cubin) and a later process loads it
with ``cute.runtime.load_module(..., enable_tvm_ffi=True)`` instead of compiling -- well under a
second instead of seconds per configuration.

* Location: ``$MLA_KERNELS_CACHE_DIR``, default ``$XDG_CACHE_HOME/mla_kernels`` (``~/.cache/...``);
  ``MLA_KERNELS_CACHE=0`` turns the on-disk store off (memory only).
* Key: the in-memory key, the compile options, the call's position in the build, and a
  fingerprint directory of everything else a compiled kernel depends on: the CuTe DSL, its libs
  wheels (the cu12 and cu13 toolchains emit different code) and TVM-FFI versions, the Python
  version, and a hash of the package's kernel sources (``common/``, ``sm90/``, ``sm100/``,
  ``tma.py``, this file).  Editing a kernel file therefore starts a fresh directory.
* Concurrency: the build of one key runs under an exclusive ``fcntl`` lock on
  ``<key>.lock``; a second process waiting on it finds the entry on disk and loads it.  Files are
  written to a temporary name and renamed (atomic), the object first, then its metadata.
* Integrity: ``<key>.json`` records the object's SHA-256 and size; an entry whose object does not
  match, or that fails to load, is deleted and rebuilt (never loaded), with one warning.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import os
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

__all__ = [
    "arch_for_capability", "arch_for_device", "compile_kernel", "cached_compile", "cache_info", "clear_cache",
    "cache_dir", "disk_store", "DiskStore", "toolchain_fingerprint", "ENV_CACHE_DIR", "ENV_CACHE",
]

ENV_CACHE_DIR = "MLA_KERNELS_CACHE_DIR"
ENV_CACHE = "MLA_KERNELS_CACHE"
#: Seconds a process waits for another one building the same key before it compiles on its own
#: (without storing the result).
LOCK_TIMEOUT_S = 900.0
_FORMAT = "v1"

_cache: Dict[Tuple, Any] = {}
_lock = threading.Lock()
#: Set by :func:`cached_compile` while its ``build()`` runs: the key under which
#: :func:`compile_kernel` stores (and looks up) its result on disk, and a call counter.
_persist: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("mla_kernels_persist", default=None)
_stats = {"compiled": 0, "loaded": 0, "stored": 0, "rebuilt": 0}
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


def arch_for_capability(major: int, minor: int) -> str:
    """``(9, 0) -> "sm_90a"``, ``(10, 0) -> "sm_100a"``, ``(10, 3) -> "sm_103a"``."""
    if (major, minor) == (9, 0):
        return "sm_90a"
    if major == 10:
        return f"sm_10{minor}a"
    raise ValueError(f"no CuTe DSL kernels for compute capability {major}.{minor}")


def arch_for_device(device) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(torch.device(device))
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

    scope = _persist.get()
    store = disk_store() if scope is not None and tvm_ffi and not (keep or dump_dir or extra_options) else None
    if store is None:
        return compile_now()
    scope[1] += 1
    return store.get_or_build((scope[0], scope[1], options), compile_now)


def cached_compile(key: Tuple, build: Callable[[], Any]):
    """Return what ``build()`` returned for ``key``, building it once per process.

    ``build`` typically constructs a kernel object and calls :func:`compile_kernel` (returning
    ``(kernel, compiled)``); those compiles go through the on-disk store under ``key``.  ``key``
    must be a tuple of plain values (str, int, bool, None) that names the static configuration
    completely."""
    fn = _cache.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _cache.get(key)
        if fn is None:
            token = _persist.set([key, 0])
            try:
                fn = build()
            finally:
                _persist.reset(token)
            _cache[key] = fn
    return fn


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


@functools.lru_cache(maxsize=None)
def toolchain_fingerprint() -> str:
    """What else a compiled kernel depends on: DSL / libs wheels / TVM-FFI / Python versions and
    :func:`sources_hash`, as one hex digest (the store's directory name)."""
    import importlib.metadata as md

    parts = [f"format={_FORMAT}", f"python={sys.version_info[0]}.{sys.version_info[1]}", f"src={sources_hash()}"]
    try:
        import cutlass

        parts.append(f"cutlass={getattr(cutlass, '__version__', '?')}@{os.path.dirname(cutlass.__file__)}")
    except Exception as e:  # pragma: no cover - no DSL: nothing will be compiled anyway
        parts.append(f"cutlass=unavailable({type(e).__name__})")
    try:
        import tvm_ffi

        parts.append(f"tvm_ffi={tvm_ffi.__version__}")
    except Exception:  # pragma: no cover
        parts.append("tvm_ffi=unavailable")
    try:
        libs = sorted(f"{d.metadata['Name']}={d.version}" for d in md.distributions()
                      if (d.metadata["Name"] or "").lower().startswith("nvidia-cutlass-dsl"))
    except Exception:  # pragma: no cover
        libs = []
    parts.extend(libs)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _dsl_export(compiled, path: str) -> None:
    compiled.export_to_c(path, function_name="mla_kernel")


_runtime_preloaded = False


def _dsl_load(path: str):
    """Load an exported object file; returns the TVM-FFI function (called like the compiled one)."""
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
    ``<h>.json`` (its key, SHA-256, size, creation time), ``<h>.lock``; ``h`` = SHA-256 of the key.

    ``export(compiled, path)`` / ``load(path)`` default to the DSL's ``export_to_c`` /
    ``load_module``; tests pass stand-ins to exercise locking and corruption without a GPU."""

    def __init__(self, root: Path, fingerprint: Optional[str] = None, export=None, load=None,
                 lock_timeout: float = LOCK_TIMEOUT_S):
        self.dir = Path(root) / (fingerprint or toolchain_fingerprint())[:24]
        self.export = export or _dsl_export
        self.load = load or _dsl_load
        self.lock_timeout = lock_timeout

    def paths(self, key) -> Tuple[Path, Path, Path]:
        h = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
        return self.dir / f"{h}.o", self.dir / f"{h}.json", self.dir / f"{h}.lock"

    def _try_load(self, key):
        """``(fn, None)`` for a valid entry, ``(None, None)`` when absent, ``(None, why)`` when the
        entry exists but is corrupt or fails to load."""
        obj, meta, _ = self.paths(key)
        if not meta.exists():
            return None, None
        try:
            info = json.loads(meta.read_text())
            data = obj.read_bytes()
        except (OSError, ValueError) as e:
            return None, f"unreadable ({type(e).__name__}: {e})"
        if info.get("key") != repr(key):
            return None, "key mismatch (hash collision or foreign file)"
        if len(data) != info.get("size") or hashlib.sha256(data).hexdigest() != info.get("sha256"):
            return None, "object file does not match its recorded SHA-256"
        try:
            with _phase("load"):
                fn = self.load(str(obj))
        except Exception as e:
            return None, f"load failed ({type(e).__name__}: {e})"
        _stats["loaded"] += 1
        return fn, None

    def _remove(self, key) -> None:
        obj, meta, _ = self.paths(key)
        for p in (meta, obj):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    def _store(self, key, compiled) -> None:
        obj, meta, _ = self.paths(key)
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{obj.name}.", suffix=".o")
        os.close(fd)
        try:
            with _phase("export"):
                self.export(compiled, tmp)
            data = Path(tmp).read_bytes()
            os.replace(tmp, obj)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        info = dict(key=repr(key), sha256=hashlib.sha256(data).hexdigest(), size=len(data),
                    created=time.strftime("%Y-%m-%dT%H:%M:%S"), pid=os.getpid())
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
        fn, why = self._try_load(key)
        if fn is not None:
            return fn
        _, _, lock = self.paths(key)
        with _FileLock(lock, self.lock_timeout) as lk:
            if lk.acquired:
                fn, why2 = self._try_load(key)  # another process may have built it meanwhile
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
