"""A small DiT-like block stack for tests: [B, S, H, D] projections, interleaved RoPE, permute, SDPA
self-attention, and cross-attention to a short text sequence (which must stay stock SDPA)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def rope_tables(S: int, D: int, base: float = 10000.0):
    inv = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = torch.arange(S, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def apply_rope(x, cos, sin):
    # x: [B, S, H, D], interleaved pairs (the Wan form)
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).type_as(x)


class Block(nn.Module):
    def __init__(self, dim, heads, text_dim):
        super().__init__()
        self.h = heads
        self.norm1 = nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm2 = nn.LayerNorm(dim)
        self.cq = nn.Linear(dim, dim)
        self.ck = nn.Linear(text_dim, dim)
        self.cv = nn.Linear(text_dim, dim)
        self.co = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, ctx, cos, sin):
        B, S, C = x.shape
        y = self.norm1(x)
        q = self.q(y).unflatten(-1, (self.h, -1))
        k = self.k(y).unflatten(-1, (self.h, -1))
        v = self.v(y).unflatten(-1, (self.h, -1))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3))
        x = x + self.o(o.permute(0, 2, 1, 3).flatten(2))
        y = self.norm2(x)
        q = self.cq(y).unflatten(-1, (self.h, -1)).transpose(1, 2)
        k = self.ck(ctx).unflatten(-1, (self.h, -1)).transpose(1, 2)
        v = self.cv(ctx).unflatten(-1, (self.h, -1)).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v)
        x = x + self.co(o.transpose(1, 2).flatten(2))
        return x + self.mlp(x)


class TinyDiT(nn.Module):
    def __init__(self, dim=128, heads=2, layers=2, text_dim=32, seq=256):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, heads, text_dim) for _ in range(layers))
        cos, sin = rope_tables(seq, dim // heads)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, x, ctx):
        for b in self.blocks:
            x = b(x, ctx, self.cos, self.sin)
        return x


def make(dtype=torch.bfloat16, seq=256, **kw):
    torch.manual_seed(0)
    m = TinyDiT(seq=seq, **kw).to(dtype).eval()
    # peaked, structured attention: scale q/k projections up so softmax is far from uniform
    with torch.no_grad():
        for b in m.blocks:
            b.q.weight.mul_(4.0)
            b.k.weight.mul_(4.0)
    x = torch.randn(2, seq, kw.get("dim", 128), dtype=dtype)
    ctx = torch.randn(2, 7, 32, dtype=dtype)
    return m, x, ctx
