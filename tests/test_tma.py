"""TMA descriptor argument checks (pure Python, CPU) and the real encode (GPU)."""

from __future__ import annotations

import pytest
import torch

from mla_kernels import tma
from mla_kernels.tma import TiledMapArgs, TmaArgumentError, check_tiled_map_args

from conftest import cuda_capability


def args(**over):
    a = dict(base_address=0x10000, elem_bytes=2, dims=(576, 1000), strides_bytes=(1152,), box=(64, 1),
             swizzle_bytes=128)
    a.update(over)
    return TiledMapArgs(**a)


def test_valid_gather_map_args():
    check_tiled_map_args(args())


@pytest.mark.parametrize(
    "over,words",
    [
        (dict(base_address=0x10008), "16-byte aligned"),
        (dict(strides_bytes=(1150,)), "multiple of 16 bytes"),
        (dict(strides_bytes=(1 << 41,)), "2^40"),
        (dict(box=(64, 300)), "box[1]=300"),
        (dict(box=(0, 1)), "box[0]=0"),
        (dict(box=(65, 1)), "multiple of 16"),
        (dict(box=(128, 1)), "128-byte swizzle spans at most 128"),
        (dict(dims=(576, 0)), "dims[1]=0"),
        (dict(dims=(576, 1 << 33)), "dims[1]"),
        (dict(dims=(32, 1000), box=(64, 1)), "exceeds dims[0]"),
        (dict(dims=(576,), strides_bytes=(), box=(64,), swizzle_bytes=128, elem_bytes=3), "element size"),
        (dict(dims=(1,) * 6, strides_bytes=(16,) * 5, box=(1,) * 6), "rank must be"),
        (dict(strides_bytes=()), "need 1 strides"),
        (dict(box=(64,)), "need 2 box"),
        (dict(swizzle_bytes=96), "swizzle must be one of"),
    ],
)
def test_invalid_args_raise(over, words):
    with pytest.raises(TmaArgumentError, match=words.replace("^", r"\^").replace("[", r"\[").replace("]", r"\]")):
        check_tiled_map_args(args(**over))


def test_kv_gather_map_args_from_tensor():
    kv = torch.zeros(100, 1, 576, dtype=torch.bfloat16)
    a = tma.kv_gather_map_args(kv)
    assert a.dims == (576, 100) and a.strides_bytes == (1152,) and a.box == (64, 1) and a.swizzle_bytes == 128
    with pytest.raises(TypeError, match="bf16"):
        tma.kv_gather_map_args(kv.float())
    with pytest.raises(ValueError, match="contiguous"):
        tma.kv_gather_map_args(torch.zeros(576, 100, dtype=torch.bfloat16).t())
    with pytest.raises(TmaArgumentError, match="aligned"):
        tma.kv_gather_map_args(torch.zeros(100 * 576 + 1, dtype=torch.bfloat16)[1:].reshape(100, 576))
    with pytest.raises(TmaArgumentError, match="multiple of 16"):
        tma.kv_gather_map_args(torch.zeros(10, 516, dtype=torch.bfloat16)[:, :512])


@pytest.mark.skipif(cuda_capability() is None, reason="needs the CUDA driver (a GPU host) to encode")
def test_encode_kv_gather_map_on_gpu():
    kv = torch.randn(4096, 576, dtype=torch.bfloat16, device="cuda")
    tmap = tma.encode_kv_gather_map(kv)
    assert tmap is not None
