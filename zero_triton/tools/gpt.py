"""A small GPT (decoder-only transformer, GPT-2's layout) for profiling and benchmarks.

The model every timing in this project that needs "a real training step" trains: token
and position embeddings, ``n_layer`` pre-norm blocks of causal self-attention and a 4x
GELU MLP, a final LayerNorm and a language-model head tied to the token embedding.
Weights are initialised as GPT-2 does (normal(0, 0.02), residual projections scaled by
1/sqrt(2 * n_layer)) from a seed, so every rank builds the same model.

    config = GPTConfig(n_layer=2, n_embd=128, n_head=4, vocab_size=2048, block_size=64)
    model = build_gpt(config, device="cpu", dtype=torch.float32)
    idx, targets = synthetic_batch(config, batch=8, seq=64, seed=rank)
    logits, loss = model(idx, targets)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 2048
    block_size: int = 64     # longest sequence: the position table's length
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    bias: bool = True        # biases in the Linear layers and LayerNorms, as GPT-2

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head "
                             f"({self.n_head}): each head gets n_embd / n_head channels")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, heads, t, c / heads)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2: one parameter, two uses

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """``idx``: (batch, seq) int64 token ids, seq <= block_size. Returns (logits of
        shape (batch, seq, vocab_size), the mean cross-entropy against ``targets`` or
        None). The loss is computed in float32 whatever the parameters' dtype."""
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence of {t} tokens, the model was built for at most "
                             f"{self.config.block_size} (GPTConfig.block_size)")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss

    def num_params(self) -> int:
        """Parameters counted once (the tied head is the embedding)."""
        return sum(p.numel() for p in self.parameters())


def _init_weights(model: GPT, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * model.config.n_layer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:          # LayerNorm gains
                p.fill_(1.0)
            else:                       # GPT-2: residual projections scaled down
                std = residual_std if name.endswith("proj.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)


def build_gpt(config: GPTConfig, *, device="cpu", dtype=torch.float32, seed: int = 0) -> GPT:
    """A GPT initialised from ``seed`` (the same weights on every rank), then moved to
    ``device`` and cast to ``dtype``."""
    model = GPT(config)
    _init_weights(model, seed)
    return model.to(device=device, dtype=dtype)


def synthetic_batch(config: GPTConfig, batch: int, seq: int, *, seed: int = 0, device="cpu"):
    """Random token ids ``idx`` of shape (batch, seq) and ``targets``, ``idx`` shifted by
    one (next-token prediction), both int64 on ``device``."""
    if not 1 <= seq <= config.block_size:
        raise ValueError(f"seq must be in [1, block_size={config.block_size}], got {seq}")
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)
