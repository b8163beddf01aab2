"""Full values of a wrapped model's groups: main weights, gradients and gathered model weights.

All functions here are collectives over each group's process group: call them on every rank.

- ``full_state_dict``: {name: full fp32 main weight} (what a checkpoint or a user wants);
  ``FSDPModel.state_dict()`` is the wrapped module's state dict with these values
  (``split_state_keys`` / ``check_buffers`` serve its ``load_state_dict``);
- ``load_full_state_dict``: main weights from full high-precision values, then the model weights
  are refreshed (the distributed quantization for block-scaled groups); every name and shape
  is checked before anything is written;
- ``full_grads``: {name: full reduced gradient, fp32};
- ``gathered_weights``: a context yielding the unsharded model weights (block-scaled planes as
  ``TorchMXFP8Tensor``, with their format's ``blocks``), views of temporary buckets valid inside
  the ``with`` only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from bridge import TorchMXFP8Tensor
from common.formats import PlaneData
from torch_side.comm.collectives import Phase
from torch_side.fsdp.batched_refresh import refresh_groups
from torch_side.fsdp.param_group import ParamGroup
from torch_side.fsdp.weight_codecs import ParamStorage

__all__ = [
    "check_buffers",
    "full_grads",
    "full_state_dict",
    "gathered_weights",
    "load_full_state_dict",
    "split_state_keys",
]


def full_state_dict(groups: list[ParamGroup]) -> dict[str, torch.Tensor]:
    """{qualified name: full fp32 main weight}."""
    out = {}
    for g in groups:
        full = g.full_main()
        for s in g.slots:
            out[s.name] = full[s.start : s.end].view(s.shape).clone()
    return out


def _check_state(groups: list[ParamGroup], state: Mapping[str, torch.Tensor]) -> None:
    expected = {s.name: s.shape for g in groups for s in g.slots}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise KeyError(
            f"load_full_state_dict: missing parameters {missing}, unexpected {unexpected}; pass "
            f"exactly the names of full_state_dict() (the wrapped module's parameter names)"
        )
    for name, shape in expected.items():
        value = state[name]
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"load_full_state_dict: {name!r} is a {type(value).__name__}, expected a "
                f"torch.Tensor of shape {shape}"
            )
        if tuple(value.shape) != tuple(shape):
            raise ValueError(
                f"load_full_state_dict: parameter {name!r} has shape {tuple(value.shape)} in "
                f"the state dict but {tuple(shape)} in the model; nothing was loaded"
            )
        if not (value.dtype.is_floating_point and value.dtype.itemsize <= 8):
            raise TypeError(
                f"load_full_state_dict: parameter {name!r} has dtype {value.dtype}; expected a "
                f"floating-point tensor (it is converted to the fp32 main weight)"
            )


def load_full_state_dict(groups: list[ParamGroup], state: Mapping[str, torch.Tensor]) -> None:
    """Set the main weights from full high-precision values and refresh the model weights."""
    _check_state(groups, state)
    for g in groups:
        g.load_main_from([state[s.name] for s in g.slots])
    refresh_groups(groups, Phase.STATE)  # block-scaled groups quantized in batches


def split_state_keys(groups: list[ParamGroup], module: torch.nn.Module) -> tuple[set, set]:
    """(parameter names, persistent buffer names) of ``module.state_dict()``'s keys."""
    params = {s.name for g in groups for s in g.slots}
    return params, set(module.state_dict()) - params


def check_buffers(module: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Refuse, before anything is written, a buffer value whose shape differs from the module's."""
    for name, value in state.items():
        have = module.get_buffer(name)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(have.shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"load_state_dict: buffer {name!r} is {got} in the state dict but has shape "
                f"{tuple(have.shape)} in the model; nothing was loaded"
            )


def full_grads(groups: list[ParamGroup]) -> dict[str, torch.Tensor]:
    """{qualified name: full reduced gradient as fp32} of every parameter that takes gradients."""
    out: dict[str, torch.Tensor] = {}
    for g in groups:
        if not g.takes_grads:
            continue
        full = g.full_main_grad()  # (a reduction still in flight is settled first)
        for s in g.slots:
            out[s.name] = full[s.start : s.end].view(s.shape).float().clone()
    return out


@contextlib.contextmanager
def gathered_weights(
    groups: list[ParamGroup],
) -> Iterator[dict[str, TorchMXFP8Tensor | torch.Tensor]]:
    """All-gather every model weight. Yields {name: unsharded value}: ``TorchMXFP8Tensor`` (both
    planes, uint8, dtype bf16, ``blocks`` the group's format) for block-scaled parameters, the
    bf16/fp32 tensor for the others. Views into temporary buckets: valid inside the ``with``
    only."""
    out = {}
    for g in groups:
        g.unshard(g.planes, Phase.STATE)
        for i, s in enumerate(g.slots):
            if g.codec.param_storage is ParamStorage.PLACEHOLDER:
                assert g.blocks is not None, g.label  # placeholders: block-scaled weights
                planes = {p: PlaneData(*g.plane_views(i, p)) for p in g.codec.compute_planes}
                out[s.name] = TorchMXFP8Tensor(planes, s.matrix_shape, g.codec.source_dtype,
                                               g.blocks)
            else:  # the full weights: a view of the full buffer
                full = g.full_buffer(g.forward_plane)
                out[s.name] = full[s.start : s.end].view(s.shape)
    try:
        yield out
    finally:
        out.clear()
        for g in groups:
            g.reshard()
