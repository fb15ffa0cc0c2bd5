"""mla_kernels: sparse MLA attention (DeepSeek-V3.2 DSA) kernels in CuTe DSL.

Public API:

* :func:`sparse_mla_fwd` -- forward: ``(out, max_logits, lse)``;
* :func:`attn_dist` -- attention distribution over the selected tokens (indexer KL target);
* :func:`sparse_mla_bwd` -- backward: ``(dq, dkv, d_attn_sink)``;
* :func:`sparse_mla` -- the autograd op (``out`` or ``(out, lse)``);
* :func:`sparse_mla_decode` -- decode on a paged KV cache (split-top-k + lse combine),
  :func:`decode_plan` -- its reusable plan (no allocation per call, CUDA-graph capturable);
* :func:`merge_attn_partials` -- merge partial results over disjoint parts of the top-k;
* :func:`backend_for` -- which backend serves a device (``"sm90"``, ``"sm100"``, ``"reference"``);
* :class:`AttnSum` -- holder receiving ``attn_sum`` from the autograd backward;
* :func:`indexer_topk` -- the lightning indexer's exact top-k keys per query (scores streamed);
* :func:`indexer_logits` -- the indexer's dense scores ``[s_q, s_kv]``;
* :func:`indexer_loss` -- the indexer's KL loss against the attention distribution (autograd).

Importing the package also registers the ops as ``torch.library`` custom ops
(``torch.ops.mla_kernels.sparse_mla_fwd``, ``attn_dist``, ``sparse_mla_bwd``,
``sparse_mla_decode``, ``merge_attn_partials``, ``indexer_logits``, ``indexer_topk``,
``indexer_loss_fwd``, ``indexer_loss_bwd``; see
:mod:`mla_kernels.ops`): ``torch.compile`` and ``torch.export`` trace through them.
"""

from .api import attn_dist, decode_plan, merge_attn_partials, sparse_mla_bwd, sparse_mla_decode, sparse_mla_fwd
from .api_indexer import indexer_logits, indexer_topk
from .autograd_indexer import indexer_loss
from .autograd import AttnSum, sparse_mla
from .decode import DecodePlan
from .dispatch import BackendUnavailableError, backend_for
from . import ops  # noqa: F401,E402  (registers torch.ops.mla_kernels.*)

__version__ = "0.1.0"

__all__ = [
    "sparse_mla_fwd",
    "attn_dist",
    "sparse_mla_bwd",
    "sparse_mla",
    "sparse_mla_decode",
    "decode_plan",
    "DecodePlan",
    "merge_attn_partials",
    "backend_for",
    "AttnSum",
    "BackendUnavailableError",
    "indexer_topk",
    "indexer_logits",
    "indexer_loss",
]
