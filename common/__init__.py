"""Shared facts of the project, framework-free (DESIGN.md 2): importing this starts neither torch
nor jax (numpy and ml_dtypes only).

- ``formats``: block size, E4M3/E8M0 constants, ``Plane``, ``WeightFormat`` with its one table of
  facts (``FORMATS``: per format its ``ScaleBlocks``, which every layer asks) and
  ``register_format`` for formats of one's own, scale shapes, the MXFP8 shape rule, the
  ``mxfp8_params()`` protocol by which a module declares its block-scaled parameters, and
  ``round_up`` / ``block_padded`` (sizes rounded up to a multiple, to whole blocks);
- ``gemm_roles``: ``GemmRole`` and the table of which plane each GEMM operand reads;
- ``modes``: ``LinearMode`` (how a linear layer multiplies), ``Activations`` (the GPT twins'
  activation dtype), ``Compute`` (one JAX op per linear or one program per FSDP unit),
  ``GatherMode`` (MXFP8 or bf16 weight all-gathers);
- ``kernels``: ``Backend``, ``GemmImpl`` and the frozen ``KernelConfig`` passed through every layer;
- ``model_config``: ``GPTConfig`` and its presets, shared by the Torch and Flax twins;
- ``enums``: ``parse_enum``, the one way user input becomes an enum member, and ``Parseable``,
  the mixin that gives an enum its ``parse`` from it;
- ``shared_pool``: ``use_shared_pool()``, which asks Torch and JAX to allocate GPU memory from one
  CUDA pool (environment only: it must run before Torch is imported).
"""

from common.enums import Parseable, parse_enum
from common.formats import (
    BLOCK_SIZE,
    E4M3_MAX,
    E8M0_BIAS,
    FORMATS,
    MXFP8_BLOCKS,
    BlockScaledParams,
    FormatKey,
    FormatSpec,
    Plane,
    RegisteredFormat,
    ScaleBlocks,
    WeightFormat,
    block_padded,
    block_scaled_params,
    check_mxfp8_shape,
    format_spec,
    parse_format,
    register_format,
    round_up,
    scale_shape,
)
from common.gemm_roles import ROLES, GemmRole, RoleSpec, role_spec
from common.kernels import Backend, GemmImpl, KernelConfig
from common.model_config import PRESETS, GPTConfig
from common.modes import Activations, Compute, GatherMode, LinearMode

__all__ = [
    "BLOCK_SIZE",
    "E4M3_MAX",
    "E8M0_BIAS",
    "FORMATS",
    "MXFP8_BLOCKS",
    "PRESETS",
    "ROLES",
    "Activations",
    "Backend",
    "BlockScaledParams",
    "Compute",
    "FormatKey",
    "FormatSpec",
    "GPTConfig",
    "GatherMode",
    "GemmImpl",
    "GemmRole",
    "KernelConfig",
    "LinearMode",
    "Parseable",
    "Plane",
    "RegisteredFormat",
    "RoleSpec",
    "ScaleBlocks",
    "WeightFormat",
    "block_padded",
    "block_scaled_params",
    "check_mxfp8_shape",
    "format_spec",
    "parse_enum",
    "parse_format",
    "register_format",
    "role_spec",
    "round_up",
    "scale_shape",
]
