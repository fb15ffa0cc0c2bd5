"""Host-side TMA (Tensor Memory Accelerator) descriptor builders and their argument checks.

Two families:

* :func:`tile_load_atom` / :func:`tile_store_atom` -- thin helpers around the DSL's
  ``cpasync.make_tiled_tma_atom`` for the dense Q / O / dO tiles.  They are called inside a
  ``@cute.jit`` host function while a kernel is being compiled.
* :func:`encode_kv_gather_map` -- a raw ``cuTensorMapEncodeTiled`` (cuda-python driver binding)
  for the KV row-gather map the sm100 kernels read with TMA gather4: bf16, 2-D ``[s_kv, d_qk]``,
  box 64 columns x 1 row, 128-byte swizzle, OOB zero fill.

Every raw-descriptor argument is checked in pure Python first (:func:`check_tiled_map_args`),
so a bad call fails with a ``ValueError`` naming the argument instead of an opaque driver error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "TmaArgumentError",
    "TiledMapArgs",
    "check_tiled_map_args",
    "kv_gather_map_args",
    "encode_tiled_map",
    "encode_kv_gather_map",
    "tile_load_atom",
    "tile_store_atom",
]

# Limits of cuTensorMapEncodeTiled (CUDA driver API, tiled mode, no interleave).
MAX_RANK = 5
MAX_BOX = 256
MAX_DIM = 1 << 32
MAX_STRIDE = 1 << 40
SWIZZLE_BYTES = (0, 32, 64, 128)


class TmaArgumentError(ValueError):
    """A TMA descriptor argument violates the hardware's rules."""


@dataclass(frozen=True)
class TiledMapArgs:
    """Arguments of one tiled TMA descriptor, innermost dimension first (the driver's order)."""

    base_address: int
    elem_bytes: int
    dims: Sequence[int]  # elements, innermost first
    strides_bytes: Sequence[int]  # rank-1 entries: byte stride of dims[1:]
    box: Sequence[int]  # elements, innermost first
    swizzle_bytes: int = 128


def check_tiled_map_args(a: TiledMapArgs) -> None:
    """Raise :class:`TmaArgumentError` if ``a`` cannot be encoded.

    Rules: 16-byte-aligned base address; 1 <= rank <= 5; every dim in [1, 2^32]; every stride a
    multiple of 16 bytes and below 2^40; every box extent in [1, 256]; the inner box row a
    multiple of 16 bytes; with a swizzle, the inner box row at most the swizzle span.
    """
    rank = len(a.dims)
    if not 1 <= rank <= MAX_RANK:
        raise TmaArgumentError(f"rank must be 1..{MAX_RANK}, got {rank}")
    if a.elem_bytes not in (1, 2, 4, 8):
        raise TmaArgumentError(f"element size must be 1, 2, 4 or 8 bytes, got {a.elem_bytes}")
    if a.base_address % 16:
        raise TmaArgumentError(f"base address must be 16-byte aligned, got 0x{a.base_address:x}")
    if len(a.strides_bytes) != rank - 1:
        raise TmaArgumentError(f"need {rank - 1} strides for rank {rank}, got {len(a.strides_bytes)}")
    if len(a.box) != rank:
        raise TmaArgumentError(f"need {rank} box extents for rank {rank}, got {len(a.box)}")
    for i, d in enumerate(a.dims):
        if not 1 <= d <= MAX_DIM:
            raise TmaArgumentError(f"dims[{i}]={d} must be in [1, 2^32]")
    for i, s in enumerate(a.strides_bytes):
        if s % 16:
            raise TmaArgumentError(f"strides[{i}]={s} bytes must be a multiple of 16 bytes")
        if not 0 < s < MAX_STRIDE:
            raise TmaArgumentError(f"strides[{i}]={s} bytes must be in (0, 2^40)")
    for i, b in enumerate(a.box):
        if not 1 <= b <= MAX_BOX:
            raise TmaArgumentError(f"box[{i}]={b} must be in [1, {MAX_BOX}]")
        if b > a.dims[i]:
            raise TmaArgumentError(f"box[{i}]={b} exceeds dims[{i}]={a.dims[i]}")
    inner = a.box[0] * a.elem_bytes
    if inner % 16:
        raise TmaArgumentError(f"inner box row is {inner} bytes; it must be a multiple of 16")
    if a.swizzle_bytes not in SWIZZLE_BYTES:
        raise TmaArgumentError(f"swizzle must be one of {SWIZZLE_BYTES} bytes, got {a.swizzle_bytes}")
    if a.swizzle_bytes and inner > a.swizzle_bytes:
        raise TmaArgumentError(
            f"inner box row is {inner} bytes but a {a.swizzle_bytes}-byte swizzle spans at most "
            f"{a.swizzle_bytes} bytes"
        )


def kv_gather_map_args(kv) -> TiledMapArgs:
    """The gather-map arguments for ``kv`` (a bf16 ``[s_kv, d_qk]`` or ``[s_kv, 1, d_qk]`` tensor):
    2-D ``(d_qk, s_kv)`` innermost first, box ``(64, 1)``, 128-byte swizzle."""
    import torch

    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dtype != torch.bfloat16:
        raise TypeError(f"the KV gather map is bf16; kv is {kv.dtype}")
    if kv.dim() == 3 and kv.shape[1] == 1:
        kv = kv.reshape(kv.shape[0], kv.shape[2])
    if kv.dim() != 2:
        raise ValueError(f"kv must be [s_kv, d_qk] or [s_kv, 1, d_qk], got {tuple(kv.shape)}")
    if kv.stride(1) != 1:
        raise ValueError("kv's last dimension must be contiguous (stride 1)")
    s_kv, d_qk = kv.shape
    args = TiledMapArgs(
        base_address=kv.data_ptr(),
        elem_bytes=2,
        dims=(d_qk, s_kv),
        strides_bytes=(kv.stride(0) * 2,),
        box=(64, 1),
        swizzle_bytes=128,
    )
    check_tiled_map_args(args)
    return args


def encode_tiled_map(a: TiledMapArgs, *, l2_promotion_bytes: int = 256):
    """Encode ``a`` with ``cuTensorMapEncodeTiled``; returns the driver's ``CUtensorMap``.

    OOB elements are zero-filled.  Needs the CUDA driver (a GPU host).
    """
    check_tiled_map_args(a)
    from cuda.bindings import driver as cu

    (err,) = cu.cuInit(0)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuInit failed: {err}")
    dtype = {
        1: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
        2: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        4: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        8: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT64,
    }[a.elem_bytes]
    swizzle = {
        0: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
        32: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B,
        64: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
        128: cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
    }[a.swizzle_bytes]
    promo = {
        0: cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_NONE,
        64: cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_64B,
        128: cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        256: cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
    }[l2_promotion_bytes]
    rank = len(a.dims)
    # Explicit cuuint64_t/cuuint32_t wrappers: some cuda-python releases reject plain ints here.
    err, tmap = cu.cuTensorMapEncodeTiled(
        dtype,
        rank,
        a.base_address,
        [cu.cuuint64_t(int(d)) for d in a.dims],
        [cu.cuuint64_t(int(s)) for s in a.strides_bytes],
        [cu.cuuint32_t(int(b)) for b in a.box],
        [cu.cuuint32_t(1)] * rank,
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        swizzle,
        promo,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: {err} for {a}")
    return tmap


def encode_kv_gather_map(kv):
    """The TMA gather4 descriptor of ``kv`` (see module docstring)."""
    return encode_tiled_map(kv_gather_map_args(kv))


# ---------------------------------------------------------------------------------------------
# DSL helpers (called while tracing a @cute.jit host function)
# ---------------------------------------------------------------------------------------------


def tile_load_atom(gmem_tensor, smem_layout, tile, num_multicast: int = 1):
    """TMA load atom + coordinate tensor for ``tile``-shaped boxes of ``gmem_tensor`` into an
    smem tile of ``smem_layout`` (its swizzle chooses the TMA swizzle mode)."""
    from cutlass.cute.nvgpu import cpasync

    op = cpasync.CopyBulkTensorTileG2SOp() if num_multicast == 1 else cpasync.CopyBulkTensorTileG2SMulticastOp()
    return cpasync.make_tiled_tma_atom(op, gmem_tensor, smem_layout, tile, num_multicast=num_multicast)


def tile_store_atom(gmem_tensor, smem_layout, tile):
    """TMA store atom + coordinate tensor writing an smem tile of ``smem_layout`` to ``tile``-shaped
    boxes of ``gmem_tensor``."""
    from cutlass.cute.nvgpu import cpasync

    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), gmem_tensor, smem_layout, tile)


def token_tile_partition(atom, tma_tensor, s_idx, tile, coord, s_tile):
    """``(smem side, gmem side)`` of one TMA copy of a per-token tile: ``tma_tensor`` is the
    ``(rows, cols, s_q)`` coordinate tensor of a tile atom, ``coord`` the (row block, column
    block) of ``tile`` within token ``s_idx``, ``s_tile`` the smem tile.  Device code (inside a
    kernel); the copy itself (``cute.copy``) elects its own lane."""
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import cpasync

    g_tile = cute.local_tile(tma_tensor[None, None, s_idx], tile, coord)
    return cpasync.tma_partition(
        atom, 0, cute.make_layout(1), cute.group_modes(s_tile, 0, 2), cute.group_modes(g_tile, 0, 2)
    )
