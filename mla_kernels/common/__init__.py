"""Code shared by the sm90 and sm100 backends.

* ``problem``  -- the normalised call description every backend receives (host, torch only);
* ``backend``  -- the backend interface and the helpers every kernel backend uses on the host;
* ``device``   -- CuTe DSL device helpers (index loading, masks, online softmax, inline PTX),
  imported lazily because importing the DSL takes a while.
"""

from .backend import OPS, Backend
from .problem import Problem

__all__ = ["OPS", "Backend", "Problem"]
