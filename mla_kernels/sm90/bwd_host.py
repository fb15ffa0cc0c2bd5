"""The backward's host side now lives in :mod:`mla_kernels.common.bwd_host` (shared with sm100);
this name stays an alias of that module (so ``monkeypatch.setattr(bwd_host, ...)`` still reaches
the real one)."""

import sys

from ..common import bwd_host as _bwd_host

sys.modules[__name__] = _bwd_host
