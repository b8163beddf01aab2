"""One training step, side by side in one launch: this project (MXFP8 and BF16 linears) vs
PyTorch FSDP2 in BF16 (and torchao float8 where importable), on the same GPT, config and batch.

Runs (``--runs``):
- ``mxfp8``: ``torch_side.fully_shard`` (ZeRO-3, one unit per block), MXFP8 linears (planes
  all-gathered as 1 byte/element), bf16 activations, fused attention, unit compute (each block's
  forward and backward, and the head with the loss, one JAX program each: ``bridge.units``);
  ``FSDPOptimizer`` (AdamW on fp32 main shards) and the distributed MXFP8 requantization.
- ``mxfp8-sync``: ``mxfp8`` without overlap (``Overlap.none()``: each unit gathered when it
  runs, gradient reductions waited for at once); ``mxfp8`` prefetches one unit ahead and reduces
  asynchronously (the default, ``torch_side.Overlap``).
- ``mxfp8-op``: the same with per-linear ops (``Compute.OP``: one JAX op per linear layer,
  LayerNorm, attention and GELU in Torch).
- ``mxfp8_bf16_gather``: ``mxfp8`` with ``GatherMode.BF16``: the MXFP8 weights are all-gathered as
  bf16 (2 bytes/element) and every rank quantizes them itself; the GEMMs read the same bytes.
- ``bf16``: ``mxfp8`` with high-precision linears and bf16 model weights (bf16 GEMMs in JAX).
- ``fsdp2``: what a user would otherwise run, PyTorch FSDP2's usual recipe: a plain PyTorch GPT
  (``benchmarks.plain_gpt``: fused QKV, ``F.scaled_dot_product_attention``, ``F.cross_entropy``;
  no JAX) from the same initial weights as this project's runs, ``torch.distributed.fsdp.
  fully_shard`` with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` per block and
  on the root, ``torch.optim.AdamW(fused=True)`` on CUDA. Eager.
- ``fsdp2-compile``: ``fsdp2`` with every block ``torch.compile``d before sharding (torchtitan's
  recipe).
- ``torchao``: ``fsdp2-compile`` with torchao's float8 training (rowwise scaling: real FP8
  tensor-core GEMMs; the LM head stays bf16, as torchtitan keeps its output layer); CUDA only,
  skipped (said so) where torchao is not importable.
- any of this project's runs with ``:u<N>`` (e.g. ``mxfp8:u4``): FSDP units of N consecutive
  blocks (``TorchGPT.block_units``; the last takes the remainder) instead of one per block: one
  gather, one reduction and, under unit compute, one JAX program per direction for N blocks.
- ``:qkv1`` at the very end (e.g. ``mxfp8:u4:qkv1``): the GPT block's qkv linear as one
  GEMM whose output is split into q, k and v (``models.gpt_math.QKV_PARTS`` off), against the
  default's three GEMMs and no cut or join (docs/mxfp8_numerics.md, "q, k and v from three
  GEMMs"); only for this project's runs.
- ``:gelu-in`` at the very end (e.g. ``mxfp8:u4:gelu-in``, ``mxfp8:u4:qkv1:gelu-in``): the
  MLP's GELU applied inside the second linear's quantize of its input
  (``models.gpt_math.GELU_IN_LINEAR`` on), against the default's XLA pass of its own that
  writes GELU(h) first (docs/mxfp8_numerics.md, "The GELU inside the second MLP linear");
  only for this project's runs.
- ``:gelu-apart`` at the very end (e.g. ``mxfp8:u4:gelu-apart``): the MLP's GELU as XLA's pass
  after its first linear's GEMM (``models.gpt_math.GELU_IN_GEMM`` off), against the default's
  GELU written by that GEMM's epilogue with the GELU's input (cuBLASLt's ``GELU_AUX`` with the
  ``fp8_blocked`` GEMM; docs/mxfp8_numerics.md, "The GELU in the GEMM's epilogue"); only for
  this project's runs.
- ``:pairs`` at the very end (e.g. ``mxfp8:u4:pairs``): ``blocked_operands.KERNEL_CONFIG``
  gets pair entries (``PAIR_CHOICE``: 128x128 blocks, 8 warps, ``whole=True``), so each
  linear's two operands of x and of dy come from one kernel call that reads x once, against
  the default's one call per output (the same bytes); only for this project's runs.
- ``:packed`` at the very end (e.g. ``mxfp8:u4:packed``, ``mxfp8:u4:pairs:packed``): the
  transposed outputs' kernels (``KERNEL_CONFIG["rows_t"]``, ``["tiles_t"]``) pack four rows'
  codes into one int32 word before the transpose (``KernelChoice.packed`` flipped from its
  default), and ``:pairs`` entries come from row-strided quarters (``PACKED_PAIR_CHOICE``)
  instead of a whole loaded block (the same bytes); only for this project's runs.
- ``:given`` at the very end (e.g. ``mxfp8:u4:given``): the transposed outputs' kernels
  (``KERNEL_CONFIG["rows_t"]``, ``["tiles_t"]``) take their colwise scale bytes from the rows'
  call (``KernelChoice.given`` flipped from its default), so they read x once instead of twice
  (the same bytes); only for this project's runs.
- ``:graphs`` at the very end (e.g. ``mxfp8:u4:graphs``): the unit programs call the cuBLASLt
  handlers' twins that XLA records into its command buffers (CUDA graphs) with the kernels
  around them (``jax_side.mxfp8.cublaslt.COMMAND_BUFFERS`` on), against the default's handlers
  launched one by one between graphs (the same bytes); only for this project's runs.
- ``:streams`` at the very end (e.g. ``mxfp8:u4:streams``): at world size 1 FSDP's gathers and
  reductions -- copies there -- run on its communication streams beside the compute, as NCCL's
  collectives do at any larger world size (``Overlap(streams_at_world_1=True)``), against the
  default's copies on the current stream; only for this project's runs.
- ``:r`` after ``:u<N>`` (e.g. ``mxfp8:u4:r``, ``bf16:u4:r``, ``mxfp8:r``): the unit programs'
  activation recompute (``TorchGPT(recompute=True)``, training's ``Recompute.BLOCK``): each
  block unit's forward keeps only its inputs and its backward program runs the forward again
  (the head with the loss keeps its own) -- less peak memory for more GPU time and, in MXFP8,
  the rowwise weight planes gathered again for the backward; the same losses, bit for bit. Only
  for runs with unit programs (not ``mxfp8-op`` nor the PyTorch runs: ValueError).

Every run steps AdamW with the same hyper-parameters (lr 1e-4, torch's defaults otherwise) on the
same tokens; on CUDA every optimizer is ``fused=True`` (this project's: ``FSDPOptimizer`` over the
fp32 main shards, one fused pass per step), on the CPU the single-tensor loop.

Per run: step time (median, min-max after warm-up), the parallel precompile
(``torch_side.precompile``, on unless ``--no-precompile``) and the first step after it,
tokens/s, host time per step (until the step function returns, before the GPU sync) and GPU time
per step (the kernel time of one warm step in torch.profiler, which sees XLA's kernels too, each
kernel counted once: the profiler's GPU-side user annotations, such as
``Optimizer.step#AdamW.step``, span kernels and are left out) split by category
(``_CATEGORIES``: GEMM, attention, quantize, optimizer, copies, collectives, other; printed as a
table after the main one), the exposed communication of that step (NCCL kernel time during which
no other kernel ran), peak GPU memory (Torch and JAX) of the run itself, above what earlier runs
of the process still held when it started (printed beside it; JAX's peak cannot be reset, so a
run whose JAX use stays below an earlier run's peak shows "?": give it a launch of its own),
all-gather / reduce-scatter bytes per step counted at the collective calls, the
distributed-quantization time (the refresh after the optimizer step: on CUDA the GPU time
between events around it, read after the step, so the step itself never waits for the GPU; host
time on the CPU), bridge crossings per step and their host time, and the ratio to fsdp2.
``--profile`` adds torch.profiler tables of one warm step of every run (its top costs by device
and by host time, and each category's kernels: the top 8, ``--profile-top N`` for more);
``--profile-copies`` adds its device copies grouped by what launched them
(``benchmarks/trace_copies.py``); ``--profile-gaps`` the GPU's idle time inside the step and its
longest gaps, each with what launched the work after it, whether that launch came after the
gap opened (the GPU waited for the host) or before, and what the step's thread was in when it
opened (``benchmarks/trace_gaps.py``); ``--profile-trace DIR`` profiles that step with Python
stacks and saves its Chrome trace (``DIR/<run>.rank<r>.trace.json.gz``, for Perfetto or
``trace_gaps.idle_gaps`` / ``trace_copies.copy_sources`` offline; the stacks add host time).

    python -m benchmarks.bench_train_step --device cpu --nproc 2 --config tiny --steps 2
    python -m benchmarks.bench_train_step --device cuda --nproc 1 --config gpt2-124m \\
        --batch-size 8 --seq-len 1024 --steps 12 --warmup 3 --profile --out bench.json
    python -m benchmarks.bench_train_step --device cuda --nproc 1 --config gpt-1.3b \\
        --batch-size 8 --seq-len 1024 --steps 6 --warmup 2 \\
        --runs fsdp2,fsdp2-compile,torchao,mxfp8:u4,bf16:u4   # scripts/gpu/scale.sh
    python -m benchmarks.bench_train_step --device cuda --nproc 1 --config gpt-1.3b \\
        --batch-size 8 --seq-len 1024 --steps 6 --warmup 2 --runs mxfp8:u4,mxfp8:u4:r
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import re
import statistics
import sys
import time

RUNS = ("mxfp8", "mxfp8-sync", "mxfp8-op", "mxfp8_bf16_gather", "bf16", "fsdp2", "fsdp2-compile",
        "torchao")
PEERS = ("fsdp2", "fsdp2-compile", "torchao")  # PyTorch's own runs (no unit count)
QKV1 = ":qkv1"  # a run's suffix: the qkv linear as one GEMM (_whole_qkv)
GELU_IN = ":gelu-in"  # a run's suffix: the GELU inside the MLP's second linear
GELU_APART = ":gelu-apart"  # a run's suffix: the GELU as a pass of its own, not in the GEMM
PAIRS = ":pairs"  # a run's suffix: the blocked-operand quantize's outputs in pairs (PAIR_CHOICE)
PACKED = ":packed"  # a run's suffix: the transposed outputs' ``packed`` flipped (KERNEL_CONFIG)
GIVEN = ":given"  # a run's suffix: the transposed outputs' ``given`` flipped (KERNEL_CONFIG)
GRAPHS = ":graphs"  # a run's suffix: the cuBLASLt handlers in XLA's command buffers
STREAMS = ":streams"  # a run's suffix: world-size-1 copies on FSDP's communication streams
# a run's trailing suffixes (any order, each once) -> what each changes: a models.gpt_math knob
# it flips from its default (KNOB_DEFAULTS), "PAIRS" (blocked_operands.KERNEL_CONFIG's pair
# entries set to PAIR_CHOICE), "PACKED" (the TRANSPOSED entries' packing flipped, pair entries
# set to PACKED_PAIR_CHOICE), "GIVEN" (the TRANSPOSED entries' ``given`` flipped) or
# "COMMAND_BUFFERS" (``jax_side.mxfp8.cublaslt.COMMAND_BUFFERS`` on) or "COMM_STREAMS" (FSDP's
# ``Overlap(streams_at_world_1=True)``: no unit program changes)
SWITCHES = {QKV1: "QKV_PARTS", GELU_IN: "GELU_IN_LINEAR", GELU_APART: "GELU_IN_GEMM",
            PAIRS: "PAIRS", PACKED: "PACKED", GIVEN: "GIVEN", GRAPHS: "COMMAND_BUFFERS",
            STREAMS: "COMM_STREAMS"}
TRANSPOSED = ("rows_t", "tiles_t")  # the KERNEL_CONFIG entries that ``:packed``, ``:given`` flip
KNOB_DEFAULTS = {"QKV_PARTS": True, "GELU_IN_LINEAR": False, "GELU_IN_GEMM": True}
PAIR_ENTRIES = ("rows+rows_t", "rows+tiles_t")
PAIR_CHOICE = (128, 128), 8, True  # (block, warps, whole): both from one loaded 128x128 block
PACKED_PAIR_CHOICE = (128, 128), 8, False, True  # ... packed: both from row-strided quarters
DEFAULT_RUNS = ("mxfp8", "mxfp8-op", "bf16", "fsdp2")


@dataclasses.dataclass
class RunResult:
    run: str
    step_ms_median: float
    step_ms_min: float
    step_ms_max: float
    first_step_s: float
    tokens_per_s: float
    peak_torch_gib: float  # this run's, above what was allocated when it started
    peak_jax_gib: float | None  # likewise; None: below an earlier run's peak (not measurable)
    gather_mb_per_step: float
    reduce_mb_per_step: float
    requant_ms: float
    crossings_per_step: float
    crossing_host_ms_per_step: float
    first_step_compiles: int
    first_step_compile_s: float
    losses: list
    host_ms_median: float = 0.0  # the step function's own time, before the final GPU sync
    gpu_ms: float = 0.0  # kernel time of one warm step (torch.profiler), 0 on CPU
    comm_ms: float = 0.0  # NCCL kernel time of that step
    exposed_comm_ms: float = 0.0  # ... of which no other kernel ran at the same time
    ratio_to_fsdp2: float | None = None
    gpu_ms_by_category: dict = dataclasses.field(default_factory=dict)  # _CATEGORIES: ms
    # GPU memory (Torch, JAX) earlier runs of the process still held at this run's start
    held_gib: list = dataclasses.field(default_factory=lambda: [0.0, 0.0])
    # --shared-pool: the one pool's peak in use (Torch and JAX together) above its use at the
    # run's start (bridge.memory_pool); None without it
    peak_pool_gib: float | None = None
    peak_pool_reserved_gib: float | None = None  # ... and the memory the pool held at most
    peak_torch_reserved_gib: float = 0.0  # Torch's own allocator: its reserved peak (absolute)
    precompile_s: float = 0.0  # torch_side.precompile before the first step (0: not run)
    precompile_programs: int = 0


class _CollectiveBytes:
    """Counts bytes this rank sends in all-gathers and reduce-scatters (any torch spelling)."""

    NAMES = {"all_gather_into_tensor": "gather", "all_gather_single": "gather",
             "reduce_scatter_tensor": "reduce", "reduce_scatter_single": "reduce"}

    def __init__(self):
        self.bytes = {"gather": 0, "reduce": 0}
        self._saved = {}

    def __enter__(self):
        import torch.distributed as dist

        for name, kind in self.NAMES.items():
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def counted(*args, _fn=fn, _kind=kind, **kwargs):
                t = kwargs.get("input_tensor", kwargs.get("input"))
                if t is None and len(args) >= 2:
                    t = args[1]
                if t is not None:
                    self.bytes[_kind] += t.numel() * t.element_size()
                return _fn(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _sync(device):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _batch(cfg, args, rank, step):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=g)
    return tokens[:, :-1].to(args.device), tokens[:, 1:].to(args.device)


def _build(run, cfg, args):
    """(model, step_fn, requant_fn or None)."""
    import torch

    from common.kernels import KernelConfig
    from common.modes import LinearMode
    from models.torch_gpt import TorchGPT
    from torch_side import (
        FSDPOptimizer,
        GatherMode,
        MixedPrecisionPolicy,
        Overlap,
        WeightFormat,
        fully_shard,
    )

    if run in PEERS:
        return _build_fsdp2(run, cfg, args)

    import jax

    from models import gpt_math

    switched = _switches(run)[1]
    if _apply_switches(switched, gpt_math):
        jax.clear_caches()  # trace this run's unit programs anew
    run, per_unit, recompute = _run_spec(run)
    mode = LinearMode.HIGH_PRECISION if run == "bf16" else LinearMode.MXFP8
    compute = "op" if run == "mxfp8-op" else "unit"
    backend = getattr(args, "backend", "")
    kernels = (KernelConfig(backend=backend or None, gemm=args.gemm or None)
               if args.gemm or backend else None)
    model = TorchGPT(cfg, mode, seed=0, device=args.device, activations="bf16", compute=compute,
                     kernels=kernels, recompute=recompute)
    gather = GatherMode.BF16 if run == "mxfp8_bf16_gather" else GatherMode.MXFP8
    policy = MixedPrecisionPolicy(other_format=WeightFormat.BF16, gather=gather)
    overlap = Overlap.none() if run == "mxfp8-sync" else Overlap()
    if "COMM_STREAMS" in switched:  # world-size-1 copies beside the compute, as NCCL's would be
        overlap = dataclasses.replace(overlap, streams_at_world_1=True)
    freed = getattr(args, "freed_grad_buckets", None)  # (None: Overlap's default)
    if freed is not None:
        overlap = dataclasses.replace(overlap, freed_grad_buckets=freed)
    # FSDP's own MXFP8 work (the refresh after each step) on the model's kernels, as
    # apps.training passes them: with an fp8_blocked GEMM the refresh's images start with only
    # their gaps zeroed (bridge.mxfp8_slices._images_kernels), not a fill of every byte
    fsdp = fully_shard(model, unit_modules=model.block_units(min(per_unit, cfg.n_layer)),
                       policy=policy, overlap=overlap, kernels=kernels)
    opt = FSDPOptimizer(fsdp, torch.optim.AdamW, **_adamw(args))
    timing = {"requant_s": 0.0, "events": []}
    refresh = fsdp.refresh_model_weights

    def timed_refresh():
        # CUDA: events around the refresh, read after the step (no sync inside the step, which
        # would make the host wait for the GPU and count that wait as host time); CPU: host time
        if args.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            refresh()
            end.record()
            timing["events"].append((start, end))
            return
        t0 = time.perf_counter()
        refresh()
        timing["requant_s"] += time.perf_counter() - t0

    fsdp.refresh_model_weights = timed_refresh  # FSDPOptimizer.step calls it after the update

    def step(tokens, targets):
        loss = fsdp(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    step.optimizer = opt  # (benchmarks.probe_memory steps it phase by phase)
    return fsdp, step, timing


def _parse_run(run: str) -> tuple[str, int]:
    """(base run, blocks per FSDP unit): ``mxfp8:u4`` -> ("mxfp8", 4); ValueError otherwise."""
    base, per_unit, _ = _run_spec(run)
    return base, per_unit


def _run_spec(run: str) -> tuple[str, int, bool]:
    """(base run, blocks per FSDP unit, activation recompute): ``mxfp8:u4:r`` -> ("mxfp8", 4,
    True); ValueError naming the run otherwise (trailing ``SWITCHES``: ``_switches``)."""
    name = _switches(run)[0]
    if name != run and name.split(":")[0] in (*PEERS, "mxfp8-op"):
        raise ValueError(f"run {run!r}: {list(SWITCHES)} change how this project's unit "
                         f"programs run the GPT block (the qkv linear as one GEMM, the GELU "
                         f"inside the linear, the quantize's outputs in pairs, packed or with "
                         f"given scales, the GEMMs in command buffers, the world-size-1 copies "
                         f"on FSDP's streams); drop them from "
                         f"{name!r}")
    name, recompute = (name[:-2], True) if name.endswith(":r") else (name, False)
    base, sep, n = name.partition(":u")
    if base not in RUNS or (sep and (base in PEERS or not n.isdigit() or int(n) < 1)):
        raise ValueError(f"unknown run {run!r}: expected one of {RUNS}; this project's (not "
                         f"{PEERS}) optionally with ':u<N>' (N >= 1 blocks per FSDP unit), then "
                         f"':r' (activation recompute), then '{QKV1}' (the qkv linear as one "
                         f"GEMM), '{GELU_IN}' (the GELU inside the linear), '{GELU_APART}' (the "
                         f"GELU apart from the GEMM's epilogue), '{PAIRS}' (the "
                         f"quantize's outputs in pairs), '{PACKED}' (its transposed "
                         f"outputs' packing flipped), '{GIVEN}' (their scales given by "
                         f"the rows' call), '{GRAPHS}' (the cuBLASLt calls in XLA's "
                         f"command buffers) and/or '{STREAMS}' (world-size-1 copies on the "
                         f"communication streams), e.g. 'mxfp8:u4:r'")
    if recompute and base in (*PEERS, "mxfp8-op"):
        raise ValueError(f"run {run!r}: ':r' is the unit programs' activation recompute; "
                         f"{base} runs no unit programs, drop ':r' (or use mxfp8 / bf16)")
    return base, int(n) if sep else 1, recompute


def _switches(run: str) -> tuple[str, frozenset[str]]:
    """(the run without its trailing ``SWITCHES``, what they change): ``:qkv1``, the GPT block
    asks its qkv linear for one output and splits it (``models.gpt_math.QKV_PARTS`` off), to
    compare with the default's three GEMMs in one launch; ``:gelu-in``, the MLP's GELU runs
    inside the second linear's quantize (``GELU_IN_LINEAR`` on), to compare with the default's
    XLA pass of its own; ``:gelu-apart``, the GELU as XLA's pass after the first linear
    (``GELU_IN_GEMM`` off) against the default's GEMM epilogue; ``:pairs``, the blocked-operand
    quantize makes each linear's two operands of x (rows and x^T tiles) and of dy (rows and
    dy^T rows) in one kernel call (``PAIR_CHOICE``: both from one loaded block), to compare
    with the default's one call per output; ``:packed``, the transposed outputs' kernels
    (``rows_t``, ``tiles_t``) with ``KernelChoice.packed`` flipped from ``KERNEL_CONFIG``'s
    default (four rows' codes per int32 word through the transpose, or not), and with
    ``:pairs`` the pair entries packed (``PACKED_PAIR_CHOICE``) instead of whole-block."""
    name, off = run, set()
    while True:
        hit = [(s, k) for s, k in SWITCHES.items() if name.endswith(s) and k not in off]
        if not hit:
            return name, frozenset(off)
        name = name.removesuffix(hit[0][0])
        off.add(hit[0][1])


def _apply_switches(switched: frozenset[str], gpt_math: object) -> bool:
    """Set ``gpt_math``'s knobs and ``KERNEL_CONFIG``'s pair entries for a run's switches;
    whether anything changed (the unit programs must then be traced anew)."""
    from jax_side.mxfp8 import blocked_operands, cublaslt

    changed = False
    for knob, default in KNOB_DEFAULTS.items():
        want = default != (knob in switched)
        if getattr(gpt_math, knob) != want:
            setattr(gpt_math, knob, want)
            changed = True
    if cublaslt.COMMAND_BUFFERS != ("COMMAND_BUFFERS" in switched):
        cublaslt.COMMAND_BUFFERS = "COMMAND_BUFFERS" in switched
        changed = True
    config = blocked_operands.KERNEL_CONFIG
    packed = "PACKED" in switched
    for e in TRANSPOSED:
        for field in ("packed", "given"):
            want = _default(e, field) != (field.upper() in switched)
            if getattr(config[e], field) != want:
                config[e] = config[e]._replace(**{field: want})
                changed = True
    pairs = {e: blocked_operands.KernelChoice(*(PACKED_PAIR_CHOICE if packed else PAIR_CHOICE))
             for e in PAIR_ENTRIES}
    has = {e: config[e] for e in PAIR_ENTRIES if e in config}
    if has != (pairs if "PAIRS" in switched else {}):
        for e in PAIR_ENTRIES:
            config.pop(e, None)
        if "PAIRS" in switched:
            config.update(pairs)
        changed = True
    return changed


@functools.cache
def _default(entry: str, field: str) -> bool:
    """``KERNEL_CONFIG[entry]``'s ``field`` as the module set it (read before any switch flips
    it)."""
    from jax_side.mxfp8 import blocked_operands

    return bool(getattr(blocked_operands.KERNEL_CONFIG[entry], field))


def _whole_qkv(run: str) -> bool:
    """``:qkv1`` among a run's trailing switches (``_switches``)."""
    return "QKV_PARTS" in _switches(run)[1]


def _adamw(args) -> dict:
    """The AdamW arguments of every run (module note): fused on CUDA, the single-tensor loop on
    the CPU."""
    cuda = args.device == "cuda"
    return {"lr": 1e-4, "fused": cuda, "foreach": False if not cuda else None}


def _build_fsdp2(run, cfg, args):
    """PyTorch FSDP2's usual recipe on the plain GPT (module note): ``fsdp2`` eager,
    ``fsdp2-compile`` with compiled blocks, ``torchao`` float8 rowwise with compiled blocks."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy as MP
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    from benchmarks.plain_gpt import from_twin

    model = from_twin(cfg, seed=0, device=args.device)
    if run == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                                   module_filter_fn=lambda mod, fqn: fqn != "lm_head")
    if run in ("fsdp2-compile", "torchao"):
        for block in model.blocks:
            block.compile()
    mp = MP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fsdp2_shard(block, mp_policy=mp)
    fsdp2_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), **_adamw(args))

    def step(tokens, targets):
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    step.optimizer = opt
    return model, step, None


def _jax_memory() -> tuple[float, float]:
    """(bytes in use, peak bytes in use) of JAX's first device, in GiB (0 where unknown)."""
    try:
        import jax

        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 -- a statistic, not a requirement
        return 0.0, 0.0
    return stats.get("bytes_in_use", 0) / 2**30, stats.get("peak_bytes_in_use", 0) / 2**30


class _Memory:
    """A run's own peak GPU memory: Torch's and JAX's, above what was allocated when the run
    started (``held``: what earlier runs of this process still held then). JAX's peak cannot be
    reset: when this run's JAX use stayed below an earlier run's peak, it is unknown (None)."""

    def __init__(self, device: str, shared_pool: bool = False):
        import torch

        self.cuda = device == "cuda"
        self.shared = self.cuda and shared_pool
        self.torch0 = self.jax0 = self.jax_peak0 = self.pool0 = 0.0
        if self.shared:  # one pool: its high-water mark is the process's (bridge.memory_pool)
            from bridge.memory_pool import pool_stats, reset_pool_peak

            torch.cuda.synchronize()
            reset_pool_peak(torch.cuda.current_device())
            self.pool0 = pool_stats(torch.cuda.current_device()).used / 2**30
        elif self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.torch0 = torch.cuda.memory_allocated() / 2**30
            self.jax0, self.jax_peak0 = _jax_memory()

    def pool_peak(self) -> tuple[float, float] | None:
        """With the shared pool: its peak use during the run above its use at the start, and
        its peak reserved memory (absolute: what it held from the device at most)."""
        if not self.shared:
            return None
        import torch

        from bridge.memory_pool import pool_stats

        torch.cuda.synchronize()
        stats = pool_stats(torch.cuda.current_device())
        return stats.used_high / 2**30 - self.pool0, stats.reserved_high / 2**30

    def peaks(self) -> tuple[float, float | None, tuple[float, float]]:
        """(Torch peak, JAX peak or None, (Torch, JAX) GiB held from earlier runs)."""
        import torch

        if not self.cuda or self.shared:  # (shared: pool_peak is the one number)
            return 0.0, 0.0, (self.pool0, 0.0)
        _, jax_peak = _jax_memory()
        jax_own = jax_peak - self.jax0 if jax_peak > self.jax_peak0 else None
        if jax_own is None and self.jax_peak0 == 0.0:
            jax_own = 0.0  # JAX never allocated in this process
        torch_own = torch.cuda.max_memory_allocated() / 2**30 - self.torch0
        return torch_own, jax_own, (self.torch0, self.jax0)


def _run_one(run, cfg, args, rank) -> RunResult:
    import torch

    from bridge import count_crossings

    memory = _Memory(args.device, args.shared_pool)
    model, step, timing = _build(run, cfg, args)
    pre_s, pre_programs = 0.0, 0
    ours = run not in PEERS
    if args.precompile and ours:
        from torch_side import precompile

        dry = torch.zeros((args.batch_size, args.seq_len), dtype=torch.long, device=args.device)
        _sync(args.device)
        t0 = time.perf_counter()
        report = precompile(model, lambda m=model: m(dry, dry))
        _sync(args.device)
        pre_s, pre_programs = time.perf_counter() - t0, report.programs
    times, host, losses = [], [], []
    first = None
    counter = _CollectiveBytes()
    crossings = None
    with counter:
        for i in range(args.warmup + args.steps):
            tokens, targets = _batch(cfg, args, rank, i)
            measured = i >= args.warmup
            if i == args.warmup:
                counter.bytes = {"gather": 0, "reduce": 0}
                if timing is not None:
                    timing["requant_s"] = 0.0
            _sync(args.device)
            compiles0 = (_COMPILES.count, _COMPILES.seconds)
            t0 = time.perf_counter()
            ctx = count_crossings() if measured and ours else contextlib.nullcontext()
            with ctx as stats:
                loss = step(tokens, targets)
                returned = time.perf_counter()
                _sync(args.device)
            dt = time.perf_counter() - t0
            if timing is not None:  # (synced above: the refresh's CUDA events are complete)
                timing["requant_s"] += sum(a.elapsed_time(b) for a, b in timing["events"]) / 1e3
                timing["events"].clear()
            if stats is not None:
                crossings = stats if crossings is None else _add(crossings, stats)
            if first is None:
                first = dt
                first_compiles = (_COMPILES.count - compiles0[0], _COMPILES.seconds - compiles0[1])
            if measured:
                times.append(dt)
                host.append(returned - t0)
                if ours:  # our FSDP logs every collective (WireRecord), per step
                    for kind, b in _wire_bytes(model.wire_log()).items():
                        counter.bytes[kind] += b
            if ours:
                model.clear_wire_log()
            losses.append(float(loss))
    torch_peak, jax_peak, held = memory.peaks()
    pool_peak = memory.pool_peak()
    n = max(1, args.steps)

    tokens_per_step = args.batch_size * args.seq_len * args.world_size
    med = statistics.median(times)
    result = RunResult(
        run=run, step_ms_median=1e3 * med, step_ms_min=1e3 * min(times),
        step_ms_max=1e3 * max(times), first_step_s=first, tokens_per_s=tokens_per_step / med,
        peak_torch_gib=torch_peak, peak_jax_gib=jax_peak, held_gib=list(held),
        gather_mb_per_step=counter.bytes["gather"] / n / 2**20,
        reduce_mb_per_step=counter.bytes["reduce"] / n / 2**20,
        requant_ms=1e3 * timing["requant_s"] / n if timing else 0.0,
        crossings_per_step=(crossings.calls / n) if crossings else 0.0,
        crossing_host_ms_per_step=(1e3 * crossings.seconds / n) if crossings else 0.0,
        first_step_compiles=first_compiles[0], first_step_compile_s=first_compiles[1],
        losses=losses, precompile_s=pre_s, precompile_programs=pre_programs,
        host_ms_median=1e3 * statistics.median(host),
    )
    if pool_peak is not None:
        result.peak_pool_gib, result.peak_pool_reserved_gib = pool_peak
    elif args.device == "cuda":
        result.peak_torch_reserved_gib = torch.cuda.max_memory_reserved() / 2**30
    if args.device == "cuda":
        (result.gpu_ms, result.comm_ms, result.exposed_comm_ms, result.gpu_ms_by_category,
         table) = _profile(step, cfg, args, rank, run)
        if args.profile and rank == 0:
            print(f"=== {run}\n{table}", flush=True)
    if args.pyprofile and _parse_run(run)[0] == "mxfp8" and rank == 0:
        print(_pyprofile(step, cfg, args, rank), flush=True)
    del model, step
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def _wire_bytes(records) -> dict:
    from torch_side import Collective, Phase

    out = {"gather": 0, "reduce": 0}
    for r in records:
        if r.op is Collective.ALL_GATHER and r.phase is not Phase.STATE:
            out["gather"] += r.bytes_sent
        elif r.op is Collective.REDUCE_SCATTER or (
            r.op is Collective.ALL_REDUCE_SUM and r.phase is Phase.GRAD_REDUCE
        ):
            out["reduce"] += r.bytes_sent
    return out


def _add(a, b):
    a.to_jax += b.to_jax
    a.to_torch += b.to_torch
    a.to_jax_s += b.to_jax_s
    a.to_torch_s += b.to_torch_s
    return a


def _union(intervals):
    """Merged, sorted (start, end) intervals."""
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _exposed(comm, compute) -> float:
    """Length of the union of ``comm`` not covered by the union of ``compute``."""
    total = 0.0
    cover = _union(compute)
    for a, b in _union(comm):
        covered = sum(max(0.0, min(b, d) - max(a, c)) for c, d in cover)
        total += (b - a) - covered
    return total


# GPU time categories, by kernel name (lower case), first match wins: XLA names its kernels by
# fusion (``gemm_fusion``, ``loop_convert_fusion``, ``wrapped_concatenate``), Torch and cuBLAS by
# function (``sm90_xmma_gemm_*``, ``nvjet_*``, ``flash_fwd_kernel``, ``multi_tensor_apply``),
# Triton (torch.compile, torchao) by the fused ops (``triton_tem_fused_mm``, ``..._amax_...``).
_CATEGORIES = (
    ("collectives", ("nccl",)),
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
    ("quantize", ("quant", "amax", "e8m0", "mxfp8", "float8", "fp8")),
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul", "triton_tem", "_mm_",
              "dot")),
    ("optimizer", ("adam", "multi_tensor_apply", "foreach")),
    ("copies", ("memcpy", "memset", "copy", "convert", "concat", "chunk_cat", "cat_", "slice",
                "pad", "transpose", "split")),
)
CATEGORY_NAMES = tuple(name for name, _ in _CATEGORIES) + ("other",)


def kernel_category(name: str) -> str:
    """The ``_CATEGORIES`` entry a GPU kernel's name falls in ("other" if none)."""
    low = name.lower()
    return next((cat for cat, keys in _CATEGORIES if any(k in low for k in keys)), "other")


def _profile(step, cfg, args, rank, run="") -> tuple[float, float, float, dict, str]:
    """(GPU kernel ms of one warm step, its NCCL kernel ms, the exposed part of those, kernel ms
    by category, the profiler's tables of its top costs). Each kernel is counted once: the
    GPU-side user annotations (``Optimizer.step#AdamW.step`` ...) span kernels, left out. With
    ``--profile-trace DIR`` the step is profiled with Python stacks and its Chrome trace saved
    as ``DIR/<run>.rank<r>.trace.json.gz`` (the stacks add host time: its numbers run high)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    tokens, targets = _batch(cfg, args, rank, 10_000)
    trace_dir = getattr(args, "profile_trace", "")
    with profile(activities=acts, with_stack=bool(trace_dir)) as prof:
        step(tokens, targets)
        _sync(args.device)
    saved = ""
    if trace_dir:  # (a profile exports its trace once: the sections below read this file)
        os.makedirs(trace_dir, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", run) or "run"
        saved = os.path.join(trace_dir, f"{name}.rank{rank}.trace.json.gz")
        prof.export_chrome_trace(saved)
    events = prof.key_averages()
    comm, compute = [], []
    by_cat = dict.fromkeys(CATEGORY_NAMES, 0.0)
    by_kernel: dict[str, list] = {}  # name -> [ms, calls]
    for e in prof.events():
        if (not str(getattr(e, "device_type", "")).endswith("CUDA")
                or getattr(e, "is_user_annotation", False)):
            continue
        span = (e.time_range.start, e.time_range.end)
        by_cat[kernel_category(e.name)] += (span[1] - span[0]) / 1e3
        entry = by_kernel.setdefault(e.name, [0.0, 0])
        entry[0] += (span[1] - span[0]) / 1e3
        entry[1] += 1
        (comm if "nccl" in e.name.lower() else compute).append(span)
    gpu_us = 1e3 * sum(by_cat.values())
    comm_us = sum(b - a for a, b in _union(comm))
    table = events.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60)
    host = events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    copies = _trace_sections(prof, args, saved)
    return gpu_us / 1e3, comm_us / 1e3, _exposed(comm, compute) / 1e3, by_cat, (
        "--- one warm step, top 25 by self device time\n" + table
        + "\n--- the same step, top 25 by self host time\n" + host
        + "\n--- the same step, GPU ms by category and kernel\n"
        + _kernels_by_category(by_kernel, args.profile_top) + copies)


def _trace_sections(prof, args, saved: str = "") -> str:
    """``--profile-copies``' and ``--profile-gaps``' sections of a profiled step (from its
    trace: ``benchmarks/trace_copies.py``, ``benchmarks/trace_gaps.py``)."""
    out = ""
    if getattr(args, "profile_copies", False) or getattr(args, "profile_gaps", False):
        from benchmarks.trace_copies import copy_sources, load_trace
        from benchmarks.trace_gaps import idle_gaps

        events = load_trace(prof, saved)
        if args.profile_copies:
            out += "\n--- the same step, where its copies come from\n" + copy_sources(events)
        if getattr(args, "profile_gaps", False):
            out += "\n--- the same step, where the GPU stands idle\n" + idle_gaps(events)
    return out


def _kernels_by_category(by_kernel: dict[str, list], top: int = 8) -> str:
    """Each category's total and its ``top`` kernels (ms, calls), kernels counted once."""
    lines = []
    for cat in CATEGORY_NAMES:
        rows = sorted(((ms, n, name) for name, (ms, n) in by_kernel.items()
                       if kernel_category(name) == cat), reverse=True)
        if not rows:
            continue
        lines.append(f"{cat}: {sum(r[0] for r in rows):.1f} ms")
        lines += [f"  {ms:8.2f} ms {n:5d}x  {name[:100]}" for ms, n, name in rows[:top]]
    return "\n".join(lines)


def _pyprofile(step, cfg, args, rank) -> str:
    """Host time by Python function over ``--pyprofile`` warm steps (cProfile)."""
    import cProfile
    import io
    import pstats

    batches = [_batch(cfg, args, rank, 20_000 + i) for i in range(args.pyprofile)]
    prof = cProfile.Profile()
    prof.enable()
    for tokens, targets in batches:
        step(tokens, targets)
    _sync(args.device)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).sort_stats("tottime")
    stats.print_stats(35)
    out.write("\n--- by cumulative time\n")
    stats.sort_stats("cumulative").print_stats(45)
    return f"=== cProfile of {args.pyprofile} warm mxfp8 steps\n" + out.getvalue()


class _CompileLog:
    """Backend compilations (count and seconds) reported by jax.monitoring."""

    def __init__(self):
        self.count, self.seconds = 0, 0.0

    def __call__(self, event, duration, **kw):
        if event.endswith("backend_compile_duration"):
            self.count += 1
            self.seconds += duration


_COMPILES = _CompileLog()


def _rank_main(args):
    if args.deterministic:  # before the first JAX computation (XLA reads its flags once)
        from bridge.determinism import make_deterministic

        make_deterministic()
    import jax
    import torch.distributed as dist

    from common.model_config import PRESETS

    jax.monitoring.register_event_duration_secs_listener(_COMPILES)
    if args.compile_cache:
        from jax_side.compile_cache import enable_compilation_cache

        enable_compilation_cache(args.compile_cache)
    rank = dist.get_rank()
    args.world_size = dist.get_world_size()
    if args.shared_pool:
        import torch

        from bridge.memory_pool import require_shared_pool

        require_shared_pool(torch.cuda.current_device())
    cfg = PRESETS[args.config]
    results = []
    for run in args.runs:
        if run == "torchao" and not _torchao_available(args):
            continue
        if rank == 0:
            print(f"--- {run}", flush=True)
        results.append(_run_one(run, cfg, args, rank))
    base = next((r for r in results if r.run == "fsdp2"), None)
    for r in results:
        if base is not None:
            r.ratio_to_fsdp2 = r.step_ms_median / base.step_ms_median
    return [dataclasses.asdict(r) for r in results]


def _torchao_available(args) -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        print("--- torchao: skipped (torchao is not importable here)", flush=True)
        return False
    if args.device != "cuda":
        print("--- torchao: skipped (float8 tensor cores need --device cuda)", flush=True)
        return False
    return True


def _table(rows, args) -> str:
    head = ("| run | step ms (median) | min-max | precompile s (programs) | "
            "first step s (compiles, s) | tokens/s | host ms | GPU ms | comm ms (exposed) | "
            "peak GiB torch+jax | "
            "gather MB/step | reduce-scatter MB/step | requant ms | crossings/step | "
            "crossing host ms | vs fsdp2 |")
    lines = [head, "|" + "---|" * 16]
    for r in rows:
        ratio = "-" if r["ratio_to_fsdp2"] is None else f"{r['ratio_to_fsdp2']:.2f}x"
        lines.append(
            f"| {r['run']} | {r['step_ms_median']:.1f} | {r['step_ms_min']:.1f}-"
            f"{r['step_ms_max']:.1f} | {r['precompile_s']:.1f} ({r['precompile_programs']}) | "
            f"{r['first_step_s']:.1f} ({r['first_step_compiles']}, "
            f"{r['first_step_compile_s']:.1f}) | {r['tokens_per_s']:,.0f} | "
            f"{r['host_ms_median']:.1f} | {r['gpu_ms']:.1f} | "
            f"{r['comm_ms']:.1f} ({r['exposed_comm_ms']:.1f}) | "
            f"{_peak_cell(r)} | {r['gather_mb_per_step']:.1f} | "
            f"{r['reduce_mb_per_step']:.1f} | {r['requant_ms']:.1f} | "
            f"{r['crossings_per_step']:.0f} | {r['crossing_host_ms_per_step']:.2f} | {ratio} |"
        )
    return "\n".join(lines)


def _peak_cell(r: dict) -> str:
    """Torch+JAX peak GiB of the run itself; JAX "?" where not measurable (``_Memory``), and
    what earlier runs still held when it started, if anything."""
    if r.get("peak_pool_gib") is not None:  # --shared-pool: Torch and JAX in one pool
        held = r.get("held_gib", (0.0, 0.0))[0]
        return (f"pool {r['peak_pool_gib']:.1f} (reserved {r['peak_pool_reserved_gib']:.1f})"
                + (f" ({held:.1f} held before)" if held >= 0.05 else ""))
    jax_peak = r["peak_jax_gib"]
    cell = f"{r['peak_torch_gib']:.1f}+{'?' if jax_peak is None else f'{jax_peak:.1f}'}"
    torch_held, jax_held = r.get("held_gib", (0.0, 0.0))
    if torch_held + jax_held < 0.05:
        return cell
    return cell + f" ({torch_held:.1f}+{jax_held:.1f} held before)"


def _category_table(rows) -> str:
    """GPU ms of one warm step by kernel category (``_CATEGORIES``), a run per column."""
    lines = ["| GPU ms, one warm step | " + " | ".join(r["run"] for r in rows) + " |",
             "|---|" + "---|" * len(rows)]
    for cat in (*CATEGORY_NAMES, "total"):
        cells = [r["gpu_ms"] if cat == "total" else r["gpu_ms_by_category"].get(cat, 0.0)
                 for r in rows]
        lines.append(f"| {cat} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--config", default="tiny")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--runs", default=",".join(DEFAULT_RUNS),
                   help=f"a comma list from {RUNS}; this project's runs take ':u<N>' for N "
                        f"blocks per FSDP unit (e.g. mxfp8:u4), then ':r' for the unit "
                        f"programs' activation recompute (e.g. mxfp8:u4:r; not mxfp8-op), "
                        f"then '{QKV1}' for the GPT's qkv linear as one GEMM and a split "
                        f", '{GELU_IN}' for the MLP's GELU inside its second linear and/or "
                        f"'{PAIRS}' for the quantize's two outputs of x and of dy in one call")
    p.add_argument("--profile", action="store_true",
                   help="print torch.profiler tables of one warm step of every run")
    p.add_argument("--profile-copies", action="store_true",
                   help="with --profile: the step's device copies grouped by what launched "
                        "them (benchmarks/trace_copies.py)")
    p.add_argument("--profile-gaps", action="store_true",
                   help="with --profile: the step's GPU idle time and its longest gaps, each "
                        "with what launched the work after it and when "
                        "(benchmarks/trace_gaps.py)")
    p.add_argument("--profile-trace", default="", metavar="DIR",
                   help="with --profile: profile with Python stacks and save each run's "
                        "Chrome trace as DIR/<run>.rank<r>.trace.json.gz (for Perfetto or "
                        "benchmarks/trace_gaps.py's functions)")
    p.add_argument("--profile-top", type=int, default=8,
                   help="kernels listed per category in --profile's table")
    p.add_argument("--pyprofile", type=int, default=0, help="cProfile N warm mxfp8 steps")
    p.add_argument("--compile-cache", default="",
                   help="persistent JAX compilation cache directory (a second launch is warm)")
    p.add_argument("--no-precompile", dest="precompile", action="store_false",
                   help="no torch_side.precompile before the first step (programs compile one "
                        "after another as the first step reaches them)")
    p.add_argument("--deterministic", action="store_true",
                   help="bridge.determinism: no XLA autotuning, deterministic Torch kernels "
                        "(what mxfp8-train does by default); measures its cost")
    p.add_argument("--gemm", default="",
                   help="the GEMM of this project's MXFP8 runs (common.kernels.GemmImpl, e.g. "
                        "fp8_blocked: Hopper's FP8 tensor cores); default: the platform's")
    p.add_argument("--backend", default="",
                   help="the kernel backend of this project's MXFP8 runs (common.kernels.Backend, "
                        "e.g. pallas); default: the platform's")
    p.add_argument("--freed-grad-buckets", type=int, default=None,
                   help="torch_side.Overlap.freed_grad_buckets of this project's runs: "
                        "handed-over grad buckets kept after their reduction until their "
                        "readers ran (default: Overlap's, 2)")
    p.add_argument("--shared-pool", action="store_true",
                   help="common.shared_pool.use_shared_pool: Torch and JAX allocate from one "
                        "CUDA memory pool (cudaMallocAsync); the peak column is then that "
                        "pool's. Every run of the launch uses it (the FSDP2 peers too)")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.shared_pool:
        if args.device != "cuda":
            p.error("--shared-pool needs --device cuda (it is a CUDA memory pool)")
        from common.shared_pool import use_shared_pool

        try:
            use_shared_pool()  # before the ranks start: they inherit the environment
        except (ValueError, RuntimeError) as e:
            p.error(str(e))
    if args.freed_grad_buckets is not None:
        from torch_side import Overlap

        try:
            Overlap(freed_grad_buckets=args.freed_grad_buckets)
        except ValueError as e:
            p.error(str(e))
    if args.gemm or args.backend:
        from common.kernels import KernelConfig

        try:
            KernelConfig(backend=args.backend or None, gemm=args.gemm or None)
        except ValueError as e:
            p.error(str(e))
    args.runs = [r for r in args.runs.split(",") if r]
    bad = []
    for r in args.runs:
        try:
            _run_spec(r)
        except ValueError as e:
            bad.append(str(e))
    if bad:
        p.error("--runs: " + "; ".join(bad))  # each names the run and what was expected
    if args.steps < 1 or args.warmup < 0:
        p.error(f"--steps >= 1 and --warmup >= 0 (got {args.steps} and {args.warmup})")
    from torch_side.launch import run_local_ranks

    rows = run_local_ranks(_rank_main, args.nproc, (args,), device=args.device)[0]
    import jax
    import torch

    header = (f"device {args.device}, {args.nproc} rank(s), config {args.config}, batch "
              f"{args.batch_size} x {args.seq_len} tokens per rank, {args.steps} timed steps "
              f"after {args.warmup} warm-up; torch {torch.__version__}, jax {jax.__version__}"
              f"{'; deterministic kernels' if args.deterministic else ''}"
              f"{f'; gemm {args.gemm}' if args.gemm else ''}"
              f"{f'; backend {args.backend}' if args.backend else ''}")
    print(header)
    print(_table(rows, args))
    if any(r["gpu_ms_by_category"] for r in rows):
        print()
        print(_category_table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
