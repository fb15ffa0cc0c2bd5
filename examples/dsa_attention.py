"""A DeepSeek-V3.2-style sparse attention (DSA) block using mla_kernels, trainable under
torch.compile(fullgraph=True): a small "lightning" indexer picks each query's top-k keys, the
sparse MLA attention attends to them, and the indexer is trained towards the attention's own
distribution over the keys it picked (the KL target from ``mla_kernels.attn_dist``).

Run it (CPU reference or a GPU kernel backend, whichever serves the device):

    python examples/dsa_attention.py [--device cuda] [--compile]
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

import mla_kernels as mk


class DSAAttention(torch.nn.Module):
    """One causal sequence ``x [s, d_model]`` -> ``(y [s, d_model], indexer KL loss)``."""

    def __init__(self, d_model: int, h_q: int = 128, d_qk: int = 576, d_v: int = 512, topk: int = 2048,
                 h_idx: int = 64, d_idx: int = 128):
        super().__init__()
        self.h_q, self.d_qk, self.d_v, self.topk, self.h_idx, self.d_idx = h_q, d_qk, d_v, topk, h_idx, d_idx
        self.scale = d_qk ** -0.5
        self.wq = torch.nn.Linear(d_model, h_q * d_qk, bias=False)
        self.wkv = torch.nn.Linear(d_model, d_qk, bias=False)  # one shared (latent) KV head
        self.wo = torch.nn.Linear(h_q * d_v, d_model, bias=False)
        self.idx_q = torch.nn.Linear(d_model, h_idx * d_idx, bias=False)
        self.idx_k = torch.nn.Linear(d_model, d_idx, bias=False)
        self.idx_w = torch.nn.Linear(d_model, h_idx, bias=False)

    def forward(self, x: torch.Tensor):
        s = x.shape[0]
        q = self.wq(x).view(s, self.h_q, self.d_qk)
        kv = self.wkv(x).view(s, 1, self.d_qk)

        # The indexer: relu(q_idx . k_idx) weighted over index heads, causal (a production model
        # streams these scores instead of materialising [s, s]).
        iq = self.idx_q(x).view(s, self.h_idx, self.d_idx)
        scores = torch.einsum("shd,td->sht", iq, self.idx_k(x)).relu()
        scores = (scores * self.idx_w(x)[:, :, None]).sum(dim=1) / math.sqrt(self.h_idx * self.d_idx)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        top = scores.topk(min(self.topk, s), dim=-1)
        valid = torch.isfinite(top.values)
        indices = torch.where(valid, top.indices, -1).to(torch.int32)  # -1: unused slot

        # Sparse attention over the selected keys; lse is returned for the indexer's target.
        out, lse = mk.sparse_mla(q, kv, indices, self.scale, self.d_v, return_lse=True)
        y = self.wo(out.reshape(s, self.h_q * self.d_v))

        # Indexer loss: KL(attention distribution over the selected keys || indexer softmax).
        with torch.no_grad():
            target = mk.attn_dist(q, kv, indices, lse, self.scale, normalize=True)  # [s, topk]
        logp = F.log_softmax(top.values.masked_fill(~valid, float("-inf")), dim=-1)
        kl = torch.where(valid, torch.xlogy(target, target) - target * logp, torch.zeros_like(logp))
        return y, kl.sum() / s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) the training step")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dev.type == "cuda":  # the kernels' configuration: d_qk 576, d_v 512, h_q a multiple of 64
        block, s, d_model = DSAAttention(1024, h_q=64, topk=256), 512, 1024
    else:  # tiny: the reference on the CPU
        block, s, d_model = DSAAttention(64, h_q=4, d_qk=32, d_v=16, topk=16, h_idx=2, d_idx=8), 48, 64
    block = block.to(dev, dtype)
    opt = torch.optim.AdamW(block.parameters(), lr=1e-3)

    def forward_loss(x):
        y, kl = block(x)
        return y.float().square().mean() + kl, kl

    if args.compile:  # one graph for the forward; AOTAutograd derives the backward graph from it
        forward_loss = torch.compile(forward_loss, fullgraph=True)
    for it in range(3):
        x = torch.randn(s, d_model, device=dev, dtype=dtype)
        loss, kl = forward_loss(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {it}: loss {loss.item():.4f}  indexer KL {kl.item():.4f}  (backend {mk.backend_for(dev)})")


if __name__ == "__main__":
    main()
