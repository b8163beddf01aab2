"""The baseline a user would otherwise run: a plain PyTorch GPT, nanoGPT style, for the FSDP2 and
torchao runs of ``bench_train_step``.

``nn.Embedding`` token and position embeddings, pre-norm blocks of ``nn.LayerNorm``, one fused QKV
``nn.Linear``, ``F.scaled_dot_product_attention(is_causal=True)``, an output projection, an MLP
with tanh GELU (``F.gelu(approximate="tanh")``), a final ``nn.LayerNorm``, an untied LM head and
``F.cross_entropy`` on fp32 logits. No biases in the linears. It computes in whatever dtype its
parameters have (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` makes that bf16): no casts of
its own, no JAX.

Its parameters are those of ``models.torch_gpt.TorchGPT`` (block ``h_<i>`` is ``blocks.<i>``
here, the rest by the same names and shapes), so ``from_twin`` starts both from the same
weights; on the same tokens the two compute the same function (a test compares their losses in
fp32).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from common.model_config import GPTConfig

__all__ = ["PlainGPT", "from_twin"]


class _Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (t.view(b, s, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class _MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.attn = _Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.mlp = _MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class PlainGPT(nn.Module):
    """``forward(tokens, targets)`` -> the mean cross-entropy (module note)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def from_twin(cfg: GPTConfig, *, seed: int, device: str | torch.device) -> PlainGPT:
    """A ``PlainGPT`` holding the initial weights of ``TorchGPT(cfg, seed=seed)`` (fp32)."""
    from models.torch_gpt import TorchGPT

    twin = TorchGPT(cfg, seed=seed, device=device, linear_impl="torch")
    with torch.device(device):
        plain = PlainGPT(cfg)
    state = {re.sub(r"^h_(\d+)\.", r"blocks.\1.", k): v for k, v in twin.state_dict().items()}
    plain.load_state_dict(state, strict=True)  # every name and shape, or it raises
    return plain
