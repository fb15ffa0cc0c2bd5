"""The first-use check of a kernel configuration that has never run on this kind of hardware.

A backend with ``hardware_verified = False`` (sm100 today: compile-proven only) may compute
garbage, crash the process (an illegal instruction poisons the CUDA context) or hang forever on
its first real run.  Before dispatch lets such a backend serve a static configuration (op, h_q,
d_qk, d_v, dtype, optional inputs, kernel choice), :func:`check` runs it on a small problem
against the PyTorch reference **in a child process with a time limit**:

* the child answers in time and the results agree -> the configuration is good;
* no answer within ``MLA_KERNELS_CHECK_TIMEOUT`` seconds (default 300: the child also compiles
  the kernel) -> "hang", the child is killed;
* the child dies (signal, non-zero exit) or the backend raises -> "crash";
* the results disagree with the reference -> "wrong".

The verdict is stored on disk (``<MLA_KERNELS_CACHE_DIR>/<fingerprint>/first_use/<key>.json``,
with the reason and the date; the fingerprint covers the kernel sources and the toolchain, so an
edited kernel is checked again) and in memory, so each configuration is checked once per machine.
A bad configuration is served by the reference, with one warning per process naming the reason
and the verdict file (delete it to check again).  ``MLA_KERNELS_CANARY=0`` turns the check off.

The child imports the backend from its ``import_spec`` (``"module:attribute"``, e.g.
``"mla_kernels.sm100:BACKEND"``); a backend without one (tests injecting objects) is checked in
the calling process instead, with no protection against a hang and no verdict on disk.  The
compiles the child makes go to the on-disk compile cache, so the parent's own first call loads
them instead of compiling again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Tuple

import torch

from . import fastpath
from .problem import Problem

ENV_CHECK = "MLA_KERNELS_CANARY"
ENV_TIMEOUT = "MLA_KERNELS_CHECK_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
_RESULT = "MLA_KERNELS_CHECK_RESULT "


def enabled() -> bool:
    return fastpath.knob(ENV_CHECK, "1").strip() != "0"


def timeout_s() -> float:
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        t = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_TIMEOUT}={raw!r}: expected a number of seconds") from None
    if not t > 0:
        raise ValueError(f"{ENV_TIMEOUT}={raw!r}: expected a positive number of seconds")
    return t


# ---------------------------------------------------------------------------------------------
# The check itself (runs in the child, or in-process for a backend without an import_spec)
# ---------------------------------------------------------------------------------------------


def describe(op: str, p: Problem) -> dict:
    """The static configuration of ``p`` as plain JSON (what the child rebuilds a problem from)."""
    return dict(
        op=op, h_q=p.h_q, d_qk=p.d_qk, d_v=p.d_v, dtype=str(p.dtype).replace("torch.", ""),
        topk_length=p.topk_length is not None,
        sink_dtype=str(p.attn_sink.dtype).replace("torch.", "") if p.attn_sink is not None else None,
        sm_scale=p.sm_scale, device=str(p.device),
    )


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.double()
    b = b.double()
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin) or not torch.equal(a[~fin], b[~fin]):
        return math.inf
    num = (a[fin] - b[fin]).norm().item()
    den = b[fin].norm().item()
    return num / max(den, 1e-30)


def run_check(backend, cfg: dict, reference) -> Tuple[bool, str]:
    """Run ``backend`` on a small problem of configuration ``cfg`` against ``reference``;
    ``(ok, reason)`` -- reason names a wrong answer or an exception (``"raised ..."``)."""
    g = torch.Generator(device="cpu").manual_seed(1234)
    op, h_q, d_qk = cfg["op"], cfg["h_q"], cfg["d_qk"]
    dev, dt = torch.device(cfg["device"]), getattr(torch, cfg["dtype"])
    s_q, s_kv, topk = 5, 300, max(2 * backend.topk_block, 128)
    q = (torch.randn(s_q, h_q, d_qk, generator=g) * 0.5).to(dev, dt)
    kv = (torch.randn(s_kv, d_qk, generator=g) * 0.5).to(dev, dt)
    idx = torch.randint(-8, s_kv + 8, (s_q, topk), generator=g).to(dev, torch.int32)
    idx = torch.where((idx < 0) | (idx >= s_kv), torch.full_like(idx, -1), idx)  # a Problem's convention
    tl = torch.tensor([topk, 0, 7, topk // 2, topk - 3], dtype=torch.int32).to(dev) if cfg["topk_length"] else None
    sink = None
    if cfg["sink_dtype"] is not None:
        sink = torch.randn(h_q, generator=g).to(dev, getattr(torch, cfg["sink_dtype"]))
    small = Problem(q, kv, idx, cfg["sm_scale"], cfg["d_v"], tl, sink, kv.shape)
    try:
        if op == "fwd":
            got = backend.fwd(small)
            want = reference.fwd(small)
            errs, tol = [_rel_err(got[0], want[0]), _rel_err(got[2], want[2])], [2e-2, 1e-4]
        elif op == "attn_dist":
            _, _, lse = reference.fwd(small)
            got = backend.attn_dist(small, lse.float(), False)
            want = reference.attn_dist(small, lse.float(), False)
            errs, tol = [_rel_err(got, want)], [1e-2]
        elif op == "bwd":
            out, _, lse = reference.fwd(small)
            dout = torch.randn(out.shape, generator=g).to(dev, dt)
            got = backend.bwd(small, out, dout, lse.float())
            want = reference.bwd(small, out, dout, lse.float())
            errs, tol = [_rel_err(got[0], want[0]), _rel_err(got[1], want[1])], [3e-2, 3e-2]
        else:
            return False, f"unknown op {op!r}"
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except Exception as e:  # a crash is a failed check, not a crash of the user's call
        return False, f"raised {type(e).__name__}: {e}"
    bad = [(e, t) for e, t in zip(errs, tol) if not e <= t]
    if bad:
        return False, f"wrong answer: relative error {bad[0][0]:.3g} > {bad[0][1]:.0e} vs the reference"
    return True, ""


def _import_spec(spec: str):
    module, _, attr = spec.partition(":")
    obj = __import__(module, fromlist=[attr or "BACKEND"])
    return getattr(obj, attr or "BACKEND")


def child_main() -> None:
    """Entry point of the child process: a JSON request on stdin, one result line on stdout."""
    req = json.loads(sys.stdin.read())
    from ..dispatch import ReferenceBackend

    backend = _import_spec(req["spec"])
    ok, why = run_check(backend, req["cfg"], ReferenceBackend())
    sys.stdout.write(_RESULT + json.dumps({"ok": ok, "reason": why}) + "\n")
    sys.stdout.flush()


def run_in_child(spec: str, cfg: dict, timeout: float) -> Tuple[bool, str]:
    """Run the check of ``cfg`` for the backend ``spec`` in a fresh Python process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the same mla_kernels, same test helpers
    env[ENV_CHECK] = "0"
    req = json.dumps({"spec": spec, "cfg": cfg})
    code = "from mla_kernels.common.first_use import child_main; child_main()"
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-c", code], input=req, capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return False, f"hang: no answer within {timeout:.0f} s ({ENV_TIMEOUT}); the check process was killed"
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(_RESULT)]
    if r.returncode != 0 or not lines:
        if r.returncode < 0:
            try:
                how = f"killed by {signal.Signals(-r.returncode).name}"
            except ValueError:
                how = f"killed by signal {-r.returncode}"
        else:
            how = f"exited with status {r.returncode}"
        tail = [ln for ln in r.stderr.strip().splitlines() if ln.strip()][-1:] or ["no error output"]
        return False, f"crash: the check process {how} after {time.monotonic() - t0:.1f} s ({tail[0][:300]})"
    res = json.loads(lines[-1][len(_RESULT):])
    reason = res["reason"]
    if not res["ok"] and reason.startswith("raised "):
        reason = "crash: " + reason
    return bool(res["ok"]), reason


# ---------------------------------------------------------------------------------------------
# Verdicts: in memory and on disk
# ---------------------------------------------------------------------------------------------

_memory: dict = {}


def device_identity(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    from .. import _compile

    major, minor = _compile.device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"


def verdict_path(key) -> Optional[Path]:
    from .. import _compile

    root = _compile.cache_dir()
    if root is None:
        return None
    h = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
    return root / _compile.toolchain_fingerprint()[:24] / "first_use" / f"{h}.json"


def _read(path: Optional[Path], key) -> Optional[dict]:
    if path is None or not path.exists():
        return None
    try:
        v = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # unreadable: check again (and overwrite it)
    if v.get("key") != repr(key) or not isinstance(v.get("ok"), bool):
        return None
    return v


def _write(path: Optional[Path], v: dict) -> None:
    if path is None:
        return
    try:
        from .._compile import _atomic_write

        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, json.dumps(v, indent=1).encode())
    except OSError:
        pass  # a read-only cache: the verdict stays in memory


def check(backend, op: str, p: Problem, reference) -> Tuple[bool, str, Optional[Path]]:
    """``(ok, reason, verdict file or None)`` for ``backend`` serving ``op`` on ``p``'s static
    configuration: from memory, from disk, or by running the check (see the module docstring)."""
    spec = getattr(backend, "import_spec", None)
    key = (backend.name, spec, backend.config_key(op, p), device_identity(p.device))
    if key in _memory:
        v = _memory[key]
        return v["ok"], v["reason"], v.get("path")
    path = verdict_path(key) if spec else None
    v = _read(path, key)
    if v is None:
        cfg = describe(op, p)
        if spec:
            ok, why = run_in_child(spec, cfg, timeout_s())
        else:
            ok, why = run_check(backend, cfg, reference)
        v = dict(key=repr(key), ok=ok, reason=why, checked=time.strftime("%Y-%m-%d %H:%M:%S"), config=cfg)
        _write(path, v)
    v["path"] = path
    _memory[key] = v
    return v["ok"], v["reason"], path


def forget() -> None:
    """Drop the in-memory verdicts (tests; the files on disk stay)."""
    _memory.clear()
