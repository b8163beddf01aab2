"""Cross-framework parity: the Torch GPT twin vs the Flax GPT twin on the same bytes.

- ``parity_report`` (``single``): one process, no FSDP, CPU or CUDA;
- ``sharded_parity_report`` (``sharded``): Torch under ``torch_side`` FSDP on spawned ranks, Flax
  on the planes FSDP all-gathered;
- ``ParityReport`` (``report``): per-layer differences, MXFP8 bytes, zero-copy pointers, verdict;
- ``unit_parity_report`` (``unit_report``): unit compute, loss / gradients / planes byte for byte;
- ``replay`` (``replay``, ``replay_state``, ``flax_adamw``): N training steps of Torch FSDP and
  the Flax twin side by side, the first divergence named;
- command line: ``python -m apps.parity`` (``cli``). Guide: docs/models_and_parity.md.
"""

from apps.parity.flax_run import Batch, FlaxRun, init_flax_params, make_batch, run_flax
from apps.parity.replay import ReplayReport, replay
from apps.parity.replay_state import ReplaySetup, setup_from_checkpoint
from apps.parity.report import (
    Diff,
    GradExactness,
    LayerBytes,
    ParityReport,
    Quantity,
    ZeroCopy,
    compare,
)
from apps.parity.sharded import parity_on_gathered, sharded_parity_report
from apps.parity.single import parity_report
from apps.parity.torch_run import LinearIO, TorchRun, run_sharded, run_torch, shard_gpt
from apps.parity.unit_report import UnitParityReport, unit_parity_report

__all__ = [
    "Batch",
    "Diff",
    "FlaxRun",
    "GradExactness",
    "LayerBytes",
    "LinearIO",
    "ParityReport",
    "Quantity",
    "ReplayReport",
    "ReplaySetup",
    "TorchRun",
    "UnitParityReport",
    "ZeroCopy",
    "compare",
    "init_flax_params",
    "make_batch",
    "parity_on_gathered",
    "parity_report",
    "replay",
    "run_flax",
    "run_sharded",
    "run_torch",
    "setup_from_checkpoint",
    "shard_gpt",
    "sharded_parity_report",
    "unit_parity_report",
]
