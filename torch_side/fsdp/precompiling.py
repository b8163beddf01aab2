"""``precompile``: compile a model's JAX linear programs in parallel before the first step.

The first step of a model with MXFP8 (or JAX high-precision) linears compiles one forward and one
backward program per distinct linear shape, one after another as the step reaches them (GPT-2
124M on an H200: 10 programs, ~13 s). ``precompile`` runs one dry forward + backward under
``bridge.compile_ahead()`` -- the linears compile their programs in worker threads and return
zeros instead of running -- then undoes every effect of the dry pass:

- gradients: ``FSDPModel.zero_grad()`` (main gradients, staged gradients and FSDP's backward
  state) or ``Module.zero_grad(set_to_none=True)``; so that nothing of the user's is lost, it
  refuses to start if the model already holds gradients;
- Torch's RNG states (CPU and every initialised CUDA device) are restored, so dropout or data
  sampling after it draws what it would have drawn without it;
- FSDP's wire log holds what it held before the call.

Weights, optimizer state and the data position are never touched (the optimizer is not called),
so a run with ``precompile`` computes bit for bit the same losses as one without (tested). Every
rank must call it when the model is sharded (the dry pass runs FSDP's collectives).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bridge.compile_ahead import AheadReport, compile_ahead
from torch_side.fsdp.fsdp_model import FSDPModel

__all__ = ["precompile"]


def _holds_grads(model: torch.nn.Module) -> bool:
    if isinstance(model, FSDPModel):
        for g in model.param_groups:
            grad = None if g.grads_cleared else g.main_grad  # cleared: no zeros filled in
            if grad is not None and bool(grad.any()):
                return True
    return any(p.grad is not None for p in model.parameters())


def _rng_states() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _restore_rng(states: tuple) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def precompile(
    model: torch.nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    *,
    no_grad_forward: bool = False,
    max_workers: int | None = None,
) -> AheadReport:
    """Compile, in parallel, every JAX program one forward + backward of ``model`` runs.

    model: an ``FSDPModel`` (from ``fully_shard``) or a plain module with MXFP8 linears.
    loss_fn: runs one micro-batch's forward of ``model`` on inputs of the training shapes and
    returns the scalar loss (``precompile`` calls its backward). Its values are meaningless (the
    linears return zeros) and are discarded. no_grad_forward: also compile the programs of a
    forward under ``torch.no_grad()`` (evaluation: the per-linear ops keep nothing for backward,
    which makes other programs; unit programs evaluate with training's), by one more call of
    ``loss_fn`` first, under no_grad. max_workers:
    compile threads (default: the CPU count, at most 16). Returns the ``bridge.AheadReport``
    (programs, wall and compile seconds).
    Call it before the first step (or right after ``zero_grad()``). See the module docstring for
    what is restored afterwards.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"precompile: model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"precompile: loss_fn must be callable, got {type(loss_fn).__name__}")
    if _holds_grads(model):
        raise ValueError(
            "precompile: the model holds gradients, which the dry pass would have to clear; call "
            "precompile before the first backward or right after zero_grad()"
        )
    fsdp = model if isinstance(model, FSDPModel) else None
    logs = {k: list(c.records) for k, c in fsdp.comms.items()} if fsdp else {}
    rng = _rng_states()
    try:
        with compile_ahead(max_workers) as ahead:
            if no_grad_forward:
                with torch.no_grad():
                    loss_fn()
            loss = loss_fn()
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
                raise TypeError(
                    "precompile: loss_fn must return a scalar tensor that requires grad (the "
                    f"loss of one forward of the model), got {_describe(loss)}"
                )
            loss.backward()
            del loss
    finally:
        if fsdp is not None:
            fsdp.zero_grad()
            for k, c in fsdp.comms.items():  # a bounded deque: put back what it held
                c.records.clear()
                c.records.extend(logs[k])
        else:
            model.zero_grad(set_to_none=True)
        _restore_rng(rng)
    return ahead.wait()


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} (requires_grad={x.requires_grad})"
    return type(x).__name__
