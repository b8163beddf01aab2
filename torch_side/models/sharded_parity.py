"""The sharded parity report: TorchGPT under ``torch_side`` FSDP on gloo CPU ranks vs FlaxGPT.

``sharded_parity_report(cfg, ...)`` spawns ``world_size`` gloo ranks (``torch_side.launch``).
Every rank wraps a Torch twin with FSDP (ZeRO-3 by default: MXFP8 planes and fp32 weights sharded,
all-gathered per block), loads the Flax checkpoint of ``seed`` into it (main weights, then the
distributed requantization), runs one forward + backward on the same batch, then enters
``gathered_weights()``; rank 0 hands the
all-gathered planes and weights to ``bridge.parity.parity_on_gathered`` (Flax reads them
zero-copy) and returns the report to the calling process.

Only Torch-side orchestration lives here; every JAX step goes through ``bridge`` (DESIGN.md 2).
"""

from __future__ import annotations

import numpy as np
import torch

from bridge.parity import Batch, ParityReport, init_flax_params, make_batch, parity_on_gathered
from jax_side.models.config import GPTConfig, MatmulMode
from torch_side.launch import run_local_ranks
from torch_side.models.fsdp_twin import load_flax_checkpoint, run_sharded, shard_gpt
from torch_side.models.gpt import TorchGPT

__all__ = ["sharded_parity_report"]


def _rank_report(
    cfg: GPTConfig, seed: int, batch: Batch, strategy: str, mode: MatmulMode
) -> ParityReport | None:
    import torch.distributed as dist

    from jax_side.models import flat_params  # the checkpoint's names = the Torch names

    master = {n: np.asarray(a) for n, a in flat_params(init_flax_params(cfg, seed)).items()}
    # Start from Torch's own (different) init, then load the Flax checkpoint into the wrapped
    # model: the "start on the Flax side" path through FSDP's main weights and requantization.
    fsdp = shard_gpt(TorchGPT(cfg, mode, seed=seed + 1), strategy)
    load_flax_checkpoint(fsdp, master)
    tokens, targets = (torch.from_numpy(a).long() for a in batch)
    torch_run = run_sharded(fsdp, tokens, targets)
    report = None
    with fsdp.gathered_weights() as gathered:
        if dist.get_rank() == 0:
            report = parity_on_gathered(
                cfg, seed, batch, torch_run, gathered, master, dist.get_world_size(), mode
            )
        dist.barrier()  # all ranks leave the gathered state together, after rank 0's JAX reads
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
    mode: MatmulMode | str = MatmulMode.MXFP8,
) -> ParityReport:
    """TorchGPT under FSDP on ``world_size`` spawned gloo CPU ranks vs FlaxGPT on the MXFP8
    planes and fp32 weights FSDP all-gathered (zero-copy). ``mode=HIGH_PRECISION``: the
    control, every weight an fp32 FSDP group.

    Every rank runs the same batch, so the DP-averaged gradient is exactly the batch gradient
    and the report is comparable row for row with ``bridge.parity.parity_report``. batch:
    explicit (tokens, targets) int (B, S), else ``make_batch(cfg, seed, batch_size, seq_len)``.
    """
    if world_size < 2:
        raise ValueError(
            f"sharded_parity_report: world_size={world_size}; use bridge.parity.parity_report "
            f"for one process without FSDP"
        )
    if batch is None:
        batch = make_batch(cfg, seed, batch_size, seq_len)
    else:
        batch = Batch(*(np.asarray(a, np.int32) for a in batch))
    job = (cfg, seed, batch, strategy, MatmulMode.parse(mode))
    return run_local_ranks(_rank_report, world_size, job)[0]  # rank 0 builds the report
