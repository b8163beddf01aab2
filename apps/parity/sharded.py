"""The sharded parity report: ``TorchGPT`` under ``torch_side`` FSDP on spawned ranks vs
``FlaxGPT`` on the very MXFP8 planes and weights FSDP all-gathered (imported zero-copy).

``sharded_parity_report(cfg, ...)`` spawns ``world_size`` ranks (``torch_side.launch``; gloo on
CPU). Every rank wraps a Torch twin with FSDP (ZeRO-3 by default: MXFP8 planes and fp32 weights
sharded, all-gathered per block), loads the Flax checkpoint of ``seed`` into it (main weights,
then the distributed requantization), runs one forward + backward on the same batch, then enters
``gathered_weights()``; rank 0 hands the all-gathered planes and weights to
``parity_on_gathered`` (Flax reads them zero-copy) and returns the report.

What equality holds at which world size: the forward (x, y, logits, loss), the MXFP8 planes and
the teacher-forced linears do not depend on the world size. Gradients are the DP average of equal
per-rank gradients, ``sum_r fl(g / W)``: exactly ``g`` for W = 1, 2, 4 (division by a power of
two and sums of equal values are exact while nothing overflows), but only to fp32 rounding for
other W (at W = 3, ``fl(g/3) * 3`` need not be ``g``). The report states this in its header and
verdict (``ParityReport.grad_exactness``) and checks teacher-forced dW within that rounding
(``report.dp_average_matches``) where W makes the average inexact.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

from apps.parity.flax_run import Batch, init_flax_params, make_batch, run_flax
from apps.parity.report import ParityReport, ZeroCopy, compare, mxfp8_bytes, same_bits
from apps.parity.single import flax_params_view
from apps.parity.torch_run import TorchRun, load_flax_checkpoint, run_sharded, shard_gpt
from bridge import TorchMXFP8Tensor, jax_work_on, to_jax_mxfp8
from common.kernels import KernelConfig
from common.model_config import GPTConfig
from common.modes import LinearMode
from jax_side.linear import quantize_weight
from jax_side.mxfp8 import MXFP8Tensor
from models.flax_gpt import flat_params, nested_params
from models.torch_gpt import TorchGPT
from torch_side.comm.collectives import barrier
from torch_side.launch import run_local_ranks

__all__ = ["parity_on_gathered", "sharded_parity_report"]


def parity_on_gathered(
    cfg: GPTConfig,
    seed: int,
    batch: Batch,
    torch_run: TorchRun,
    gathered: Mapping[str, TorchMXFP8Tensor | torch.Tensor],
    master: Mapping[str, np.ndarray],
    world_size: int,
    mode: LinearMode = LinearMode.MXFP8,
    kernels: KernelConfig | None = None,
) -> ParityReport:
    """The sharded report, on one rank: FlaxGPT on what FSDP all-gathered vs the FSDP run.

    gathered: ``FSDPModel.gathered_weights()`` (MXFP8 weights as ``TorchMXFP8Tensor`` with both
    uint8 planes, the rest fp32), imported zero-copy (the report records every data pointer);
    torch_run: the FSDP model's captured run (``apps.parity.torch_run.run_sharded``);
    master: the full fp32 weights FSDP was loaded with, to check its planes against quantizing
    bf16(master) on one device. mode: HIGH_PRECISION for the control (no MXFP8 groups).
    Call inside the ``gathered_weights`` context.
    """
    planes_t = {n: t for n, t in gathered.items() if isinstance(t, TorchMXFP8Tensor)}
    if (mode is LinearMode.MXFP8) != bool(planes_t):
        raise ValueError(
            f"parity_on_gathered: mode {mode.value} but FSDP gathered {len(planes_t)} MXFP8 "
            f"weights; wrap the Torch twin built with the same LinearMode"
        )
    flax_in = _import_gathered(gathered)
    flax_planes = nested_params(flax_in.planes) if flax_in.planes else None
    flax_run = run_flax(cfg, mode, nested_params(flax_in.shared), batch.tokens, batch.targets,
                        planes=flax_planes, kernels=kernels)
    diffs, layers = compare(cfg, mode, torch_run, flax_run, flax_in.weights,
                            flax_in.planes or None, kernels, world_size)
    if flax_in.planes:
        layers = _planes_match_single_device(layers, flax_in.planes, master, kernels)
    return ParityReport(
        cfg, mode, seed, batch.tokens.shape, world_size, diffs, layers, flax_in.zero_copy
    )


class _Imported(NamedTuple):
    """What FSDP gathered, as Flax reads it (zero-copy)."""

    planes: dict[str, MXFP8Tensor]  # MXFP8 weights, sharing the Torch planes' memory
    weights: dict[str, torch.Tensor]  # high-precision weights + zero dW slots of MXFP8 weights
    shared: dict[str, jax.Array]  # ``weights`` as JAX arrays on the same memory
    zero_copy: tuple[ZeroCopy, ...]  # the data pointers of every tensor Flax reads


def _import_gathered(gathered: Mapping[str, TorchMXFP8Tensor | torch.Tensor]) -> _Imported:
    planes_t = {n: t for n, t in gathered.items() if isinstance(t, TorchMXFP8Tensor)}
    hp = {n: t for n, t in gathered.items() if not isinstance(t, TorchMXFP8Tensor)}
    planes = {n: to_jax_mxfp8(t) for n, t in planes_t.items()}
    # MXFP8 weights: FSDP gathers no high-precision copy; Flax gets a zero slot for dW only.
    slots = {
        n: torch.zeros(t.shape, dtype=torch.float32, device=t.rowwise().data.device)
        for n, t in planes_t.items()
    }
    weights = {**hp, **slots}
    shared = flax_params_view(weights)
    zero_copy = [ZeroCopy(n, hp[n].data_ptr(), shared[n].unsafe_buffer_pointer()) for n in hp]
    for n, t in planes_t.items():
        for plane, pair in t.planes.items():
            for part, tt, jj in zip(("data", "scale"), pair, planes[n].plane(plane), strict=True):
                zero_copy.append(ZeroCopy(
                    f"{n}:{plane.value}_{part}", tt.data_ptr(), jj.unsafe_buffer_pointer()
                ))
    return _Imported(planes, weights, shared, tuple(zero_copy))


def _planes_match_single_device(layers, planes, master, kernels):
    """The planes both stacks used (pointer-equal) must also be the bytes of quantizing the full
    bf16(master) on one device: FSDP's distributed quantization is exact. Folds that check into
    each layer's ``weight_identical``."""

    def single_device(name: str) -> MXFP8Tensor:
        return quantize_weight(jnp.asarray(master[name + ".weight"]), kernels=kernels)

    return tuple(
        lb._replace(weight_identical=lb.weight_identical and same_bits(
            mxfp8_bytes(planes[lb.name + ".weight"]), mxfp8_bytes(single_device(lb.name))))
        for lb in layers
    )


def _rank_report(
    cfg: GPTConfig, seed: int, batch: Batch, strategy: str, mode: LinearMode, device: str,
    kernels: KernelConfig | None = None,
) -> ParityReport | None:
    # JAX work on this rank's tensors' device: CPU for gloo ranks (also on a GPU machine), the
    # rank's only visible GPU for NCCL ranks.
    with jax_work_on(device):
        return _rank_report_on(cfg, seed, batch, strategy, mode, device, kernels)


def _rank_report_on(
    cfg: GPTConfig, seed: int, batch: Batch, strategy: str, mode: LinearMode, device: str,
    kernels: KernelConfig | None,
) -> ParityReport | None:
    import torch.distributed as dist

    master = {n: np.asarray(a) for n, a in flat_params(init_flax_params(cfg, seed)).items()}
    # Start from Torch's own (different) init, then load the Flax checkpoint into the wrapped
    # model: the "start on the Flax side" path through FSDP's main weights and requantization.
    fsdp = shard_gpt(TorchGPT(cfg, mode, seed=seed + 1, device=device, kernels=kernels),
                     strategy, kernels)
    load_flax_checkpoint(fsdp, master)
    tokens, targets = (torch.tensor(a, dtype=torch.long, device=device) for a in batch)
    torch_run = run_sharded(fsdp, tokens, targets)
    report = None
    with fsdp.gathered_weights() as gathered:
        if dist.get_rank() == 0:
            report = parity_on_gathered(
                cfg, seed, batch, torch_run, gathered, master, dist.get_world_size(), mode,
                kernels,
            )
        # all ranks leave the gathered state together, after rank 0's JAX reads
        barrier("the sharded parity report")
    return report


def sharded_parity_report(
    cfg: GPTConfig,
    *,
    seed: int = 0,
    batch_size: int = 2,
    seq_len: int = 40,
    world_size: int = 2,
    strategy: str = "optim_grads_params",
    batch: Batch | None = None,
    mode: LinearMode | str = LinearMode.MXFP8,
    device: str = "cpu",
    kernels: KernelConfig | None = None,
) -> ParityReport:
    """TorchGPT under FSDP on ``world_size`` spawned ranks vs FlaxGPT on the MXFP8 planes and
    fp32 weights FSDP all-gathered (zero-copy). ``mode=HIGH_PRECISION``: the control, every
    weight an fp32 FSDP group. device: "cpu" (gloo ranks) or "cuda" (NCCL, one GPU per rank;
    Torch and Flax of a rank on its GPU).

    Every rank runs the same batch, so the report is comparable row for row with
    ``apps.parity.single.parity_report`` (gradients exactly for world sizes 1, 2, 4, to fp32
    rounding otherwise: ``ParityReport.grad_exactness``). batch:
    explicit (tokens, targets) int (B, S), else ``make_batch(cfg, seed, batch_size, seq_len)``.
    """
    if world_size < 2:
        raise ValueError(
            f"sharded_parity_report: world_size={world_size}; use apps.parity.parity_report "
            f"for one process without FSDP"
        )
    if batch is None:
        batch = make_batch(cfg, seed, batch_size, seq_len)
    else:
        batch = Batch(*(np.asarray(a, np.int32) for a in batch))
    if device not in ("cpu", "cuda"):
        raise ValueError(f"sharded_parity_report: device {device!r}; use 'cpu' or 'cuda'")
    job = (cfg, seed, batch, strategy, LinearMode.parse(mode), device, kernels)
    # rank 0 builds the report
    return run_local_ranks(_rank_report, world_size, job, device=device)[0]
