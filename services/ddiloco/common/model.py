"""A small GPT-style language model over bytes (vocabulary 256), readable in one sitting.

Pre-norm transformer blocks, causal self-attention through
``torch.nn.functional.scaled_dot_product_attention``, a 4x GELU MLP, learned positions, and
an output head tied to the token embedding.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddiloco.common.config import ModelConfig

VOCAB = 256


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model {cfg.d_model} is not divisible by n_head {cfg.n_head}")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(VOCAB, cfg.d_model)
        self.wpe = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied: one tensor, listed once by named_parameters
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"sequence of {t} bytes exceeds the context of {self.cfg.context}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))
        return logits, loss


def build_model(cfg: ModelConfig, seed: int) -> GPT:
    """Same seed, same initial weights, in every process."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return GPT(cfg)
    finally:
        torch.random.set_rng_state(gen_state)


def gpt_parameter_count(cfg: ModelConfig) -> int:
    """The parameters ``GPT(cfg)`` holds, without building it (the head is tied to the token
    embedding): the byte and position embeddings, per block two LayerNorms (4d), qkv
    (3d^2 + 3d), the projection (d^2 + d) and the MLP (4d^2 + 4d and 4d^2 + d), and the final
    LayerNorm (2d). A reader checks a file's declared configuration against the values it
    holds with this before it builds anything that large."""
    d = cfg.d_model
    return VOCAB * d + cfg.context * d + cfg.n_layer * (12 * d * d + 13 * d) + 2 * d


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def is_embedding(name: str) -> bool:
    """Tensors that merges average plainly (no radial-directional averaging)."""
    return name.startswith(("wte.", "wpe."))


@torch.no_grad()
def evaluate(model: GPT, windows: torch.Tensor, batch_size: int = 16) -> tuple[float, float]:
    """Mean next-byte cross-entropy (nats) and accuracy over fixed evaluation windows."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total_loss, correct, count = 0.0, 0, 0
    for i in range(0, windows.shape[0], batch_size):
        batch = windows[i : i + batch_size].to(device)
        x, y = batch[:, :-1], batch[:, 1:]
        logits, loss = model(x, y)
        total_loss += float(loss) * y.numel()
        correct += int((logits.argmax(-1) == y).sum())
        count += y.numel()
    model.train(was_training)
    return total_loss / count, correct / count
