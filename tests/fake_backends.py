"""Kernel-backend stand-ins that a first-use check *child process* can import (by
``import_spec``, e.g. ``"fake_backends:SLEEPING"``): each serves every op through the reference,
except that it sleeps forever, crashes the process, raises or returns wrong values."""

from __future__ import annotations

import os
import signal
import time

from mla_kernels.dispatch import ReferenceBackend


class FakeUnverified(ReferenceBackend):
    hardware_verified = False
    topk_block = 4

    def __init__(self, mode: str, name: str = "sm100"):
        self.mode = mode
        self.name = name
        self.import_spec = f"fake_backends:{mode.upper()}"
        self.calls = []

    def _misbehave(self):
        if self.mode == "sleeping":
            time.sleep(3600)
        if self.mode == "crashing":
            os.kill(os.getpid(), signal.SIGSEGV)
        if self.mode == "raising":
            raise RuntimeError("CUDA error: an illegal instruction was encountered")

    def fwd(self, p):
        self.calls.append("fwd")
        self._misbehave()
        out, ml, lse = super().fwd(p)
        return (out + 1.0, ml, lse) if self.mode == "wrong" else (out, ml, lse)

    def attn_dist(self, p, lse, normalize):
        self.calls.append("attn_dist")
        self._misbehave()
        res = super().attn_dist(p, lse, normalize)
        return res * 2 if self.mode == "wrong" else res

    def bwd(self, p, out, dout, lse, **kw):
        self.calls.append("bwd")
        self._misbehave()
        return super().bwd(p, out, dout, lse, **kw)


GOOD = FakeUnverified("good")
SLEEPING = FakeUnverified("sleeping")
CRASHING = FakeUnverified("crashing")
RAISING = FakeUnverified("raising")
WRONG = FakeUnverified("wrong")
