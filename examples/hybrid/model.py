"""A GPT-style decoder, built one pipeline stage at a time.

Pre-LayerNorm blocks (causal self-attention + MLP), learned position embeddings, an
untied LM head.  Stage 0 holds the embeddings, the last stage the final norm and the
head.  Each part is initialised from its own seed (seed, part index), so a parameter's
initial value does not depend on how the blocks are split into stages: a job can be
re-partitioned (or re-launched with another --pp) and start from the same model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.config import ModelConfig
from hybrid.data import IGNORE_INDEX

_INIT_STD = 0.02


def _init_(module: nn.Module, generator: torch.Generator) -> nn.Module:
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            nn.init.normal_(sub.weight, 0.0, _INIT_STD, generator=generator)
            if sub.bias is not None:
                nn.init.zeros_(sub.bias)
        elif isinstance(sub, nn.Embedding):
            nn.init.normal_(sub.weight, 0.0, _INIT_STD, generator=generator)
    return module


def _generator(seed: int, part: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + part)


class Block(nn.Module):
    """One pre-LN transformer block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        shape = (b, t, self.num_heads, d // self.num_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPTStage(nn.Module):
    """Blocks ``layers`` of the model, plus the embeddings on the first stage and the
    final norm and LM head on the last.

    forward: first stage (B, L) int64 tokens -> (B, L, dim); middle stages
    (B, L, dim) -> (B, L, dim); last stage -> (B, L, vocab) logits.
    """

    def __init__(self, cfg: ModelConfig, layers: range, *, first: bool, last: bool, seed: int) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            g = _generator(seed, 0)
            self.tok_emb = _init_(nn.Embedding(cfg.vocab_size, cfg.dim), g)
            self.pos_emb = _init_(nn.Embedding(cfg.max_seq_len, cfg.dim), g)
        self.blocks = nn.ModuleList(_init_(Block(cfg), _generator(seed, 1 + i)) for i in layers)
        if last:
            g = _generator(seed, 1 + cfg.num_layers)
            self.ln_f = nn.LayerNorm(cfg.dim)
            self.head = _init_(nn.Linear(cfg.dim, cfg.vocab_size, bias=False), g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(pos)[None]
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the next-token cross-entropies over the non-padding targets.

    Shapes: logits (B, L, V), targets (B, L) -> scalar.
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
