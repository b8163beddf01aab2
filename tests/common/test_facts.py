"""The shared facts (``common``): one table per fact, validated configs, one enum parser."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from common import (
    BLOCK_SIZE,
    FORMATS,
    GPTConfig,
    KernelConfig,
    LinearMode,
    Parseable,
    Plane,
    WeightFormat,
    block_padded,
    check_mxfp8_shape,
    format_spec,
    parse_enum,
    role_spec,
    round_up,
    scale_shape,
)
from common.formats import (
    ALL_PLANES,
    MXFP8_BLOCKS,
    FormatSpec,
    RegisteredFormat,
    ScaleBlocks,
    parse_format,
    register_format,
)
from common.kernels import Backend, GemmImpl, Platform
from common.model_config import GPT2_124M, GPT2_350M, GPT_1_3B, GPT_2_7B, PRESETS

ROOT = Path(__file__).resolve().parents[2]


def test_every_weight_format_has_one_row_and_planes_follow_block_scaling():
    assert set(FORMATS) == set(WeightFormat)
    for fmt, spec in FORMATS.items():
        assert spec.forward_plane is Plane.ROWWISE, fmt
        if spec.blocks is None:
            assert spec.planes == (Plane.ROWWISE,) and spec.buffer_dtype == spec.source_dtype
        else:
            assert spec.backward_plane is Plane.COLWISE and spec.buffer_dtype == "uint8"
    mx = format_spec("mxfp8_e4m3")
    assert (mx.blocks.block_size, mx.blocks.element_max) == (BLOCK_SIZE, 448.0)
    assert mx.source_dtype == "bfloat16"  # DESIGN.md 3: quantize bf16(fp32 master)
    assert format_spec(WeightFormat.NVFP4).blocks.block_size == 16  # described, not implemented


def test_shape_rules_and_scale_shapes():
    mx = format_spec(WeightFormat.MXFP8_E4M3)
    assert mx.shape_problem((64, 96)) is None
    assert "multiples of 32" in mx.shape_problem((40, 64))
    assert "2-D" in mx.shape_problem((64,))
    assert format_spec(WeightFormat.FP32).shape_problem((3, 5, 7)) is None
    assert scale_shape((64, 96), Plane.ROWWISE) == (64, 3)
    assert scale_shape((64, 96), Plane.COLWISE) == (2, 96)
    assert check_mxfp8_shape((64, 96), "w") == (64, 96)
    with pytest.raises(ValueError, match=r"w: MXFP8 needs M % 32 == 0.*\(40, 64\).*\(64, 64\)"):
        check_mxfp8_shape((40, 64), "w")


def test_scale_blocks_describe_each_plane_of_any_block_format():
    """The per-format object every layer asks (issue 31): MXFP8's blocks give the layout of
    DESIGN.md 4, and NVFP4's row says what it is -- 16-element blocks, two 4-bit elements per
    byte, E4M3 block scales and an fp32 tensor-level scale."""
    assert format_spec("mxfp8_e4m3").blocks is MXFP8_BLOCKS
    assert MXFP8_BLOCKS.block_shape(Plane.ROWWISE) == (1, 32)
    assert MXFP8_BLOCKS.block_shape(Plane.COLWISE) == (32, 1)
    assert MXFP8_BLOCKS.data_shape((64, 96)) == (64, 96)
    assert MXFP8_BLOCKS.scale_numel((64, 96)) == 64 * 96 // 32
    nv = format_spec(WeightFormat.NVFP4).blocks
    assert (nv.elements_per_byte, nv.tensor_scale_dtype, nv.scale_dtype) == (
        2, "float32", "float8_e4m3fn")
    assert nv.data_shape((64, 96)) == (64, 48)
    assert nv.scale_shape((64, 96), Plane.ROWWISE) == (64, 6)
    assert scale_shape((64, 96), Plane.COLWISE, nv) == (4, 96)
    assert "multiples of 16" in nv.shape_problem((40, 64))
    with pytest.raises(ValueError, match="elements per byte"):
        ScaleBlocks("float4_e2m1fn", "float8_e4m3fn", 15, 6.0, elements_per_byte=2)


def test_a_format_of_ones_own_is_registered_beside_the_built_in_ones():
    row = FormatSpec("uint8", "bfloat16", ALL_PLANES,
                     ScaleBlocks("float8_e4m3fn", "float8_e8m0fnu", 16, 448.0))
    key = register_format("test_b16", row)
    try:
        assert key == RegisteredFormat("test_b16") and key.name == "TEST_B16"
        assert format_spec("test_b16") is row and parse_format("TEST_B16") == key
        assert register_format("test_b16", row) == key  # the same row again: the same key
        with pytest.raises(ValueError, match="already the format"):
            register_format("test_b16", FORMATS[WeightFormat.MXFP8_E4M3])
        with pytest.raises(ValueError, match="already the format"):
            register_format("mxfp8_e4m3", row)
        with pytest.raises(ValueError, match="lower-case letters"):
            register_format("B 16", row)
    finally:
        del FORMATS[key]
    with pytest.raises(ValueError, match="unknown weight format 'test_b16'.*register_format"):
        format_spec("test_b16")


def test_gemm_role_table():
    fwd, dgrad, wgrad = (role_spec(r) for r in ("forward", "dgrad", "wgrad"))
    assert (fwd.a_plane, fwd.b_plane) == (Plane.ROWWISE, Plane.ROWWISE)
    assert (dgrad.a_plane, dgrad.b_plane) == (Plane.ROWWISE, Plane.COLWISE)
    assert (wgrad.a_plane, wgrad.b_plane, wgrad.a_contract) == (Plane.COLWISE, Plane.COLWISE, 0)


def test_kernel_config_is_frozen_parsed_and_refuses_te_with_a_gemm():
    cfg = KernelConfig("xla", "dequant_bf16_dot")
    assert cfg == KernelConfig(Backend.XLA, GemmImpl.DEQUANT_BF16_DOT) and hash(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.backend = Backend.TE
    with pytest.raises(ValueError, match="te backend runs Transformer Engine's own GEMM"):
        KernelConfig("te", "dequant_dot")
    with pytest.raises(ValueError, match=r"unknown matmul impl 'fp8'.*dequant_bf16_dot"):
        KernelConfig(gemm="fp8")
    assert KernelConfig.reference() == KernelConfig("xla", "dequant_dot")


def test_one_enum_parser_one_error_format():
    assert parse_enum(LinearMode, "MXFP8", what="mode") is LinearMode.MXFP8
    assert LinearMode.parse(LinearMode.HIGH_PRECISION) is LinearMode.HIGH_PRECISION
    with pytest.raises(ValueError, match=r"unknown linear mode 'fp32': expected one of"):
        LinearMode.parse("fp32")
    assert Plane.parse("columnwise") is Plane.COLWISE


def test_every_enum_parse_is_the_one_parser():
    """``Parseable`` gives each enum its ``parse`` (no class writes the wrapper again), and what
    its class keywords say reaches the error."""
    own = []
    for top in ("common", "jax_side", "bridge", "torch_side", "apps"):
        for path in sorted((ROOT / top).rglob("*.py")):
            own += [f"{path.relative_to(ROOT)}: {n.name}"
                    for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)
                    and any(isinstance(f, ast.FunctionDef) and f.name == "parse" for f in n.body)]
    assert own == ["common/enums.py: Parseable"], "use common.enums.Parseable"
    assert issubclass(Platform, Parseable) and "parse" not in vars(Platform)
    with pytest.raises(ValueError, match=r"^unknown platform 'tpu': expected one of \['cpu', "
                       r"'gpu'\] \(or None for JAX's default device\)$"):
        Platform.parse("tpu")
    with pytest.raises(ValueError, match=r"of \['rowwise', 'colwise', 'columnwise'\]$"):
        Plane.parse("diagonal")


def test_sizes_round_up_to_a_multiple_and_to_whole_blocks():
    assert [round_up(n, 32) for n in (0, 1, 32, 33)] == [0, 32, 32, 64]
    assert [block_padded(n) for n in (0, 1, 32, 33)] == [32, 32, 32, 64]
    assert block_padded(17, block=16) == 32


def test_gpt_presets_validate_and_count_parameters():
    assert set(PRESETS) >= {"tiny", "small", "gpt2-124m", "gpt2-350m"}
    # GPT-2 124M has a tied LM head (124.4M with vocab 50304); ours is untied: + 50304 * 768
    assert GPT2_124M.num_parameters() - 50304 * 768 == pytest.approx(124.4e6, rel=0.01)
    assert GPT2_350M.num_parameters() - 50304 * 1024 == pytest.approx(355e6, rel=0.01)
    # GPT-3 XL and 2.7B (tied heads, 2048 positions): 1.3B and 2.7B, plus our untied head
    assert GPT_1_3B.num_parameters() - 50304 * 2048 == pytest.approx(1.32e9, rel=0.01)
    assert GPT_2_7B.num_parameters() - 50304 * 2560 == pytest.approx(2.65e9, rel=0.01)
    with pytest.raises(ValueError, match=r"vocab_size=50257.*use 50272"):
        GPTConfig(vocab_size=50257)
