"""The Torch GPT twin: same math and parameter names as ``models.flax_gpt.FlaxGPT``.

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

Two activation modes (``Activations``): ``FP32``, the twin (fp32 activations, attention written
out with the Flax twin's formula: what the parity tests compare), and ``BF16``, the training path
(bf16 activations, fused attention ``F.scaled_dot_product_attention``, LayerNorm and the loss
computed in fp32 from bf16 inputs). ``LinearImpl.TORCH`` builds plain ``nn.Linear`` layers instead
of the bridge's (no JAX at all): the model PyTorch-only baselines such as FSDP2 run.

Compute (``common.modes.Compute``): the above is ``Compute.OP``. With ``Compute.UNIT`` each
``Block`` runs as one JAX program per direction (``bridge.units``) whose math is the Flax twin's
(``models.gpt_math``: LayerNorm, attention -- cuDNN for bf16 on a GPU --, GELU, the
residuals), and ``model(tokens, targets)`` runs the final norm, LM head and loss as one more;
the parameters, their names and FSDP's view of them are the same in both.

FSDP: the linear weights are the MXFP8 parameters (2-D, dims multiples of 32); embeddings and
LayerNorm stay in a high-precision group. ``torch_side`` FSDP supplies the MXFP8 planes to each
``MXFP8Linear`` through its ``weight_planes`` argument.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from bridge import MXFP8Linear
from bridge.units import register_unit, run_unit, set_compute
from common.kernels import KernelConfig
from common.model_config import GPTConfig
from common.modes import Activations, Compute, LinearMode
from models.gpt_math import GPTBlockFn, GPTHeadFn

__all__ = [
    "Activations",
    "Compute",
    "LinearImpl",
    "TorchGPT",
    "cross_entropy",
    "load_flat_params",
    "mxfp8_linears",
]


class LinearImpl(enum.Enum):
    BRIDGE = "bridge"  # bridge.MXFP8Linear: JAX GEMMs (MXFP8 or high precision, by LinearMode)
    TORCH = "torch"  # torch.nn.Linear: PyTorch only, for baselines


class _Spec(NamedTuple):
    """How a model's layers are built (shared by every block)."""

    mode: LinearMode
    kernels: KernelConfig | None
    activations: Activations
    linear_impl: LinearImpl


class TorchLinear(nn.Linear):
    """``nn.Linear`` (no bias) computing in the input's dtype (a no-op cast when the weight
    already has it, e.g. under FSDP2's bf16 ``param_dtype``)."""

    def __init__(self, fin: int, fout: int):
        super().__init__(fin, fout, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))


def _linear(fin: int, fout: int, spec: _Spec) -> nn.Module:
    if spec.linear_impl is LinearImpl.TORCH:
        return TorchLinear(fin, fout)
    return MXFP8Linear(fin, fout, bias=False, mode=spec.mode, kernels=spec.kernels)


class LayerNorm(nn.Module):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` (biased variance), as in the Flax twin."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:  # training path: fp32 statistics, output in x's dtype
            w, b = self.weight.float(), self.bias.float()
            return F.layer_norm(x.float(), w.shape, w, b, self.eps).to(x.dtype)
        mean = x.mean(dim=-1, keepdim=True)
        var = (x - mean).square().mean(dim=-1, keepdim=True)
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, spec: _Spec):
        super().__init__()
        self.cfg, self.fused = cfg, spec.activations is Activations.BF16
        self.qkv = _linear(cfg.d_model, 3 * cfg.d_model, spec)
        self.proj = _linear(cfg.d_model, cfg.d_model, spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h, hd = self.cfg.n_head, self.cfg.head_dim
        q, k, v = self.qkv(x).split(d, dim=-1)  # 3 x (B, S, D)
        q, k, v = (t.reshape(b, s, h, hd).transpose(1, 2) for t in (q, k, v))  # (B, H, S, hd)
        if self.fused:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, S, hd)
            return self.proj(out.transpose(1, 2).reshape(b, s, d))  # (B, S, D)
        att = torch.einsum("bhqd,bhkd->bhqk", q, k) * hd**-0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)  # (B, H, S, S)
        out = torch.einsum("bhqk,bhkd->bhqd", att, v)  # (B, H, S, hd)
        return self.proj(out.transpose(1, 2).reshape(b, s, d))  # (B, S, D)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, spec: _Spec):
        super().__init__()
        self.fc = _linear(cfg.d_model, cfg.d_ff, spec)
        self.proj = _linear(cfg.d_ff, cfg.d_model, spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, spec: _Spec):
        super().__init__()
        self.activations = spec.activations
        self.ln_1 = LayerNorm(cfg.d_model, cfg.ln_eps)
        self.attn = Attention(cfg, spec)
        self.ln_2 = LayerNorm(cfg.d_model, cfg.ln_eps)
        self.mlp = MLP(cfg, spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _block_fn(block: Block) -> GPTBlockFn:
    """The block's JAX function (``gpt_math``): cuDNN attention where the block is on a GPU."""
    on_gpu = block.ln_1.weight.device.type == "cuda"
    return GPTBlockFn(block.attn.cfg, block.activations, fused_attention=on_gpu)


register_unit(Block, _block_fn)


class TorchGPT(nn.Module):
    """tokens int64 (B, S), S <= max_seq_len -> logits (B, S, vocab_size) in the activation dtype;
    with ``targets`` (int (B, S)) -> the mean token cross-entropy, an fp32 scalar.

    Initialised like GPT-2 (normal(0, init_std) weights, LayerNorm ones/zeros) from ``seed``;
    ``load_flat_params`` replaces that with a Flax checkpoint. Parameters are fp32 (FSDP's policy
    decides the model weights' format); ``activations`` picks the twin (FP32) or the training path
    (BF16); ``linear_impl=TORCH`` builds plain ``nn.Linear`` layers (no JAX).

    compute: ``Compute.OP`` runs the Torch code above, each linear a ``bridge.MXFP8Linear`` op;
    ``Compute.UNIT`` runs each block as one JAX program per direction (``bridge.units``: the
    block math of ``models.gpt_math``, the Flax twin's) and, when ``targets`` are given,
    the final norm, LM head and loss as one more (the logits never reach Torch). Embeddings stay
    Torch ops in both. ``recompute`` (UNIT only): every block recomputes its forward inside its
    backward program instead of keeping activations (use ``torch.utils.checkpoint`` with OP).
    """

    def __init__(
        self,
        cfg: GPTConfig,
        mode: LinearMode | str = LinearMode.MXFP8,
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
        kernels: KernelConfig | None = None,
        activations: Activations | str = Activations.FP32,
        linear_impl: LinearImpl | str = LinearImpl.BRIDGE,
        compute: Compute | str = Compute.OP,
        recompute: bool = False,
    ):
        super().__init__()
        self.cfg, self.mode, self.kernels = cfg, LinearMode.parse(mode), kernels
        self.activations = Activations.parse(activations)
        self.linear_impl = LinearImpl(linear_impl)
        spec = _Spec(self.mode, kernels, self.activations, self.linear_impl)
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        for i in range(cfg.n_layer):
            self.add_module(f"h_{i}", Block(cfg, spec))
        self.ln_f = LayerNorm(cfg.d_model, cfg.ln_eps)
        self.lm_head = _linear(cfg.d_model, cfg.vocab_size, spec)
        gen = torch.Generator().manual_seed(seed)
        for p in self.parameters():
            if p.dim() == 2:
                with torch.no_grad():
                    p.normal_(0.0, cfg.init_std, generator=gen)
        self.to(device)
        self.compute = Compute.OP
        self.set_compute(compute, recompute=recompute)

    def set_compute(self, compute: Compute | str, *, recompute: bool = False) -> None:
        """Switch between per-linear ops and unit programs (class docstring)."""
        compute = Compute.parse(compute)
        if compute is Compute.UNIT and self.linear_impl is LinearImpl.TORCH:
            raise ValueError(
                "TorchGPT: compute=unit runs the blocks in JAX, but linear_impl=torch builds "
                "PyTorch-only layers; use compute=op for the PyTorch baselines"
            )
        if recompute and compute is not Compute.UNIT:
            raise ValueError(
                "TorchGPT: recompute=True is the unit programs' activation recompute; with "
                "compute=op wrap the blocks in torch.utils.checkpoint instead"
            )
        set_compute(self, compute, recompute=recompute)
        self.compute = compute

    @property
    def blocks(self) -> list[Block]:
        return [getattr(self, f"h_{i}") for i in range(self.cfg.n_layer)]

    def block_units(self, blocks_per_unit: int = 1) -> list:
        """``fully_shard``'s ``unit_modules`` for FSDP units of ``blocks_per_unit`` consecutive
        blocks (the last takes the remainder): ``[Block]`` for one each, else lists of blocks,
        each one unit -- one gather, one reduction and, under ``Compute.UNIT``, one JAX program
        per direction. The numbers are the same for every choice."""
        k = blocks_per_unit
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.cfg.n_layer:
            raise ValueError(
                f"TorchGPT.block_units: blocks_per_unit={k!r}, expected an integer from 1 to "
                f"the model's n_layer={self.cfg.n_layer}"
            )
        if k == 1:
            return [Block]
        blocks = self.blocks
        return [tuple(blocks[i:i + k]) for i in range(0, len(blocks), k)]

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        b, s = tokens.shape
        if s > self.cfg.max_seq_len:
            raise ValueError(
                f"TorchGPT: sequence length {s} exceeds max_seq_len={self.cfg.max_seq_len}; "
                f"truncate the batch or build a config with a larger max_seq_len"
            )
        if targets is not None and tuple(targets.shape) != (b, s):
            raise ValueError(
                f"TorchGPT: targets of shape {tuple(targets.shape)} must match tokens {(b, s)}"
            )
        pos = torch.arange(s, device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)  # (B, S, D)
        if self.activations is Activations.BF16:
            x = x.to(torch.bfloat16)
        for block in self.blocks:
            x = block(x)
        if targets is None:
            return self.lm_head(self.ln_f(x))  # (B, S, V)
        if self.compute is Compute.UNIT:
            return run_unit(self, GPTHeadFn(self.cfg), x, targets, parts=("ln_f", "lm_head"))
        return cross_entropy(self.lm_head(self.ln_f(x)), targets)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, fp32 scalar; logits (B, S, V), targets int (B, S).

    Same formula as the Flax twin: ``-mean(log_softmax(logits)[target])``, computed in fp32
    (bf16 logits of the training path are widened first).
    """
    logp = logits.float().log_softmax(dim=-1)
    return -logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1).mean()


def mxfp8_linears(model: nn.Module) -> Iterator[tuple[str, MXFP8Linear]]:
    """(module name, layer) of every linear layer, in forward order."""
    for name, mod in model.named_modules():
        if isinstance(mod, MXFP8Linear):
            yield name, mod


def load_flat_params(model: TorchGPT, flat: Mapping[str, object]) -> None:
    """Copy a Flax checkpoint (``models.flax_gpt.flat_params``: name -> array) into the model.

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
