"""The single-process parity report: ``TorchGPT`` (bridge op, no FSDP) vs ``FlaxGPT`` on the
Torch parameters imported zero-copy, on one device (CPU or CUDA)."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
import torch

from apps.parity.flax_run import Batch, check_batch, init_flax_params, make_batch, run_flax
from apps.parity.report import ParityReport, ZeroCopy, compare
from apps.parity.torch_run import run_torch
from bridge import jax_work_on, to_jax
from common.kernels import KernelConfig
from common.model_config import GPTConfig
from common.modes import LinearMode
from models.flax_gpt import flat_params, nested_params
from models.torch_gpt import TorchGPT, load_flat_params

__all__ = ["flax_params_view", "parity_report"]


def flax_params_view(weights: Mapping[str, torch.Tensor]) -> dict[str, jax.Array]:
    """Torch tensors as JAX arrays over the same memory (``to_jax``, zero-copy)."""
    return {n: to_jax(t.detach()) for n, t in weights.items()}


def parity_report(
    cfg: GPTConfig,
    *,
    seed: int = 0,
    batch_size: int = 2,
    seq_len: int = 40,
    mode: LinearMode | str = LinearMode.MXFP8,
    device: str = "cpu",
    batch: Batch | None = None,
    kernels: KernelConfig | None = None,
) -> ParityReport:
    """Single process, no FSDP: TorchGPT (bridge op) vs FlaxGPT on the Torch parameters.

    device: where the Torch model lives ("cpu" or "cuda"); JAX runs on the same device (the
    bridge op runs its kernels where its tensors are; Flax gets the same buffers).
    batch: explicit (tokens, targets) int (B, S); default ``make_batch(cfg, seed, batch_size,
    seq_len)``. kernels: the ``KernelConfig`` both twins' MXFP8 linears run (None: the default for
    the device).

    Flax initialises from ``seed``; Torch loads that checkpoint; Flax then runs on the Torch
    parameters imported zero-copy, each MXFP8 layer quantizing bf16(weight) exactly as the
    bridge op does.
    """
    mode = LinearMode.parse(mode)
    batch = check_batch(cfg, batch) if batch is not None else make_batch(
        cfg, seed, batch_size, seq_len)
    with jax_work_on(device):  # Flax's JAX work on the Torch tensors' device (CPU in a GPU run)
        return _parity_report(cfg, seed, mode, device, batch, kernels)


def _parity_report(cfg: GPTConfig, seed: int, mode: LinearMode, device: torch.device | str,
                   batch: Batch, kernels: KernelConfig | None) -> ParityReport:
    model = TorchGPT(cfg, mode, device=device, kernels=kernels)
    flat = {n: np.asarray(a) for n, a in flat_params(init_flax_params(cfg, seed)).items()}
    load_flat_params(model, flat)
    tokens, targets = (torch.tensor(a, dtype=torch.long, device=device) for a in batch)
    torch_run = run_torch(model, tokens, targets)
    weights = {n: p.detach() for n, p in model.named_parameters()}
    shared = flax_params_view(weights)
    zero_copy = tuple(
        ZeroCopy(n, weights[n].data_ptr(), a.unsafe_buffer_pointer()) for n, a in shared.items()
    )
    flax_run = run_flax(
        cfg, mode, nested_params(shared), batch.tokens, batch.targets, kernels=kernels
    )
    diffs, layers = compare(cfg, mode, torch_run, flax_run, weights, kernels=kernels)
    return ParityReport(cfg, mode, seed, batch.tokens.shape, 1, diffs, layers, zero_copy)
