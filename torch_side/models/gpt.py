"""The Torch GPT twin: same math and parameter names as ``jax_side.models.FlaxGPT``.

Parameters (``state_dict`` names = Flax param paths joined with "."), all float32:
``wte.weight`` (V, D), ``wpe.weight`` (S, D), ``h_<i>.{ln_1,ln_2}.{weight,bias}`` (D,),
``h_<i>.attn.qkv.weight`` (3D, D), ``h_<i>.attn.proj.weight`` (D, D), ``h_<i>.mlp.fc.weight``
(F, D), ``h_<i>.mlp.proj.weight`` (D, F), ``ln_f.{weight,bias}`` (D,), ``lm_head.weight`` (V, D).

Every linear layer is a ``bridge.MXFP8Linear`` (no bias): its GEMMs are the one JAX MXFP8 linear
(``jax_side.linear``) behind a Torch autograd op, with the model's ``KernelConfig``, or the
high-precision control (``LinearMode.HIGH_PRECISION``). Everything else (embeddings, LayerNorm,
attention, GELU, residuals) is plain Torch in float32, written with the same formulas as the Flax
twin; those ops are the only ones whose bytes can differ between the twins (different kernels,
summation orders).

FSDP: the linear weights are the MXFP8 parameters (2-D, dims multiples of 32); embeddings and
LayerNorm stay in a high-precision group. ``torch_side`` FSDP supplies the MXFP8 planes to each
``MXFP8Linear`` through its ``weight_planes`` argument.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from bridge import MXFP8Linear
from common.kernels import KernelConfig
from common.model_config import GPTConfig
from common.modes import LinearMode

__all__ = ["TorchGPT", "cross_entropy", "load_flat_params", "mxfp8_linears"]


def _linear(fin: int, fout: int, mode: LinearMode, kernels: KernelConfig | None) -> MXFP8Linear:
    return MXFP8Linear(fin, fout, bias=False, mode=mode, kernels=kernels)


class LayerNorm(nn.Module):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` (biased variance), as in the Flax twin."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=-1, keepdim=True)
        var = (x - mean).square().mean(dim=-1, keepdim=True)
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, mode: LinearMode, kernels: KernelConfig | None):
        super().__init__()
        self.cfg = cfg
        self.qkv = _linear(cfg.d_model, 3 * cfg.d_model, mode, kernels)
        self.proj = _linear(cfg.d_model, cfg.d_model, mode, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h, hd = self.cfg.n_head, self.cfg.head_dim
        q, k, v = self.qkv(x).split(d, dim=-1)  # 3 x (B, S, D)
        q, k, v = (t.reshape(b, s, h, hd).transpose(1, 2) for t in (q, k, v))  # (B, H, S, hd)
        att = torch.einsum("bhqd,bhkd->bhqk", q, k) * hd**-0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)  # (B, H, S, S)
        out = torch.einsum("bhqk,bhkd->bhqd", att, v)  # (B, H, S, hd)
        return self.proj(out.transpose(1, 2).reshape(b, s, d))  # (B, S, D)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, mode: LinearMode, kernels: KernelConfig | None):
        super().__init__()
        self.fc = _linear(cfg.d_model, cfg.d_ff, mode, kernels)
        self.proj = _linear(cfg.d_ff, cfg.d_model, mode, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, mode: LinearMode, kernels: KernelConfig | None = None):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.d_model, cfg.ln_eps)
        self.attn = Attention(cfg, mode, kernels)
        self.ln_2 = LayerNorm(cfg.d_model, cfg.ln_eps)
        self.mlp = MLP(cfg, mode, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TorchGPT(nn.Module):
    """tokens int64 (B, S), S <= max_seq_len -> logits float32 (B, S, vocab_size).

    Initialised like GPT-2 (normal(0, init_std) weights, LayerNorm ones/zeros) from ``seed``;
    ``load_flat_params`` replaces that with a Flax checkpoint.
    """

    def __init__(
        self,
        cfg: GPTConfig,
        mode: LinearMode | str = LinearMode.MXFP8,
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
        kernels: KernelConfig | None = None,
    ):
        super().__init__()
        self.cfg, self.mode, self.kernels = cfg, LinearMode.parse(mode), kernels
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        for i in range(cfg.n_layer):
            self.add_module(f"h_{i}", Block(cfg, self.mode, kernels))
        self.ln_f = LayerNorm(cfg.d_model, cfg.ln_eps)
        self.lm_head = _linear(cfg.d_model, cfg.vocab_size, self.mode, kernels)
        gen = torch.Generator().manual_seed(seed)
        for p in self.parameters():
            if p.dim() == 2:
                with torch.no_grad():
                    p.normal_(0.0, cfg.init_std, generator=gen)
        self.to(device)

    @property
    def blocks(self) -> list[Block]:
        return [getattr(self, f"h_{i}") for i in range(self.cfg.n_layer)]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        if s > self.cfg.max_seq_len:
            raise ValueError(
                f"TorchGPT: sequence length {s} exceeds max_seq_len={self.cfg.max_seq_len}; "
                f"truncate the batch or build a config with a larger max_seq_len"
            )
        pos = torch.arange(s, device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)  # (B, S, D)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, S, V)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, fp32 scalar; logits (B, S, V), targets int (B, S).

    Same formula as the Flax twin: ``-mean(log_softmax(logits)[target])``.
    """
    logp = logits.log_softmax(dim=-1)
    return -logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1).mean()


def mxfp8_linears(model: nn.Module) -> Iterator[tuple[str, MXFP8Linear]]:
    """(module name, layer) of every linear layer, in forward order."""
    for name, mod in model.named_modules():
        if isinstance(mod, MXFP8Linear):
            yield name, mod


def load_flat_params(model: TorchGPT, flat: Mapping[str, object]) -> None:
    """Copy a Flax checkpoint (``jax_side.models.flat_params``: name -> array) into the model.

    Names and shapes must match exactly (the twins share them); values are copied (the Torch
    model owns its parameters), as float32.
    """
    state = model.state_dict()
    missing, extra = sorted(set(state) - set(flat)), sorted(set(flat) - set(state))
    if missing or extra:
        raise KeyError(
            f"load_flat_params: checkpoint names differ from TorchGPT's: missing {missing}, "
            f"unexpected {extra}; was it saved from a FlaxGPT with the same GPTConfig?"
        )
    with torch.no_grad():
        for name, value in flat.items():
            arr = np.asarray(value)
            if tuple(arr.shape) != tuple(state[name].shape):
                raise ValueError(
                    f"load_flat_params: {name} has shape {arr.shape} in the checkpoint but "
                    f"{tuple(state[name].shape)} in TorchGPT({model.cfg})"
                )
            state[name].copy_(torch.from_numpy(arr.astype(np.float32)).to(state[name].device))
