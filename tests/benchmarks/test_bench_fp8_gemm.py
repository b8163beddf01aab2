"""``benchmarks/bench_fp8_gemm.py`` runs on the CPU in its smoke mode (one tiny GEMM, the Pallas
kernel interpreted) and refuses a timed run without a GPU."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_fp8_gemm


def test_the_smoke_run_times_bf16_and_the_kernel(tmp_path):
    out = tmp_path / "fp8.json"
    assert bench_fp8_gemm.main(["--smoke", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["gemm"]
    assert row["shape"] == [128, 128, 128]
    assert row["bf16_ms"] > 0 and row["kernel[128,128,8,3]_ms"] > 0


def test_a_timed_run_needs_a_gpu(capsys):
    import jax

    if jax.devices()[0].platform == "gpu":
        pytest.skip("CPU-only behaviour (on a GPU this is the whole benchmark)")
    with pytest.raises(SystemExit):
        bench_fp8_gemm.main([])
    assert "no GPU" in capsys.readouterr().err


def test_the_torch_operands_mean_the_same_gemm():
    """``torch_blockwise`` lays the re-blocked bytes out as ``torch.nn.functional.scaled_mm``'s
    BlockWise1x128 x BlockWise128x128 recipe reads them (a's scales stride 1 along M, b's tile
    scales padded along K/128 to a multiple of 4 and transposed): its product, emulated in Torch
    as that recipe defines it, equals the exact GEMM of the re-blocked operands."""
    import numpy as np
    import torch

    from jax_side import mxfp8
    from jax_side.mxfp8.reblock import blocked_dot_reference, reblock_rows, reblock_tiles

    a, b = bench_fp8_gemm._operands(128, 256, 384)
    ra = reblock_rows(*bench_fp8_gemm._rowwise(mxfp8.quantize(a)))
    rb = reblock_tiles(*bench_fp8_gemm._rowwise(mxfp8.quantize(b)))
    ta, tbt, sa, sb = bench_fp8_gemm.torch_blockwise(ra, rb)
    assert ta.dtype == tbt.dtype == torch.float8_e4m3fn
    assert (tuple(ta.shape), tuple(tbt.shape)) == ((128, 256), (256, 384))
    assert tuple(sa.shape) == (128, 2) and sa.stride(0) == 1
    assert tuple(sb.shape) == (4, 3)  # K/128 = 2 padded to 4, by N/128 = 3
    a32 = ta.float() * sa.repeat_interleave(128, dim=1)
    b32 = tbt.float() * sb[:2].repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
    got = (a32.double() @ b32.double()).numpy()
    want = np.asarray(blocked_dot_reference(ra, rb), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("role", ["forward", "dgrad", "wgrad"])
def test_the_bf16_column_of_each_role_is_that_roles_product(role):
    """The role table's bf16 dot picks the operands and contraction of ``mxfp8.matmul``'s role:
    on the same (bf16-exact) values the two agree to fp32 rounding."""
    import jax
    import numpy as np
    from jax import lax

    from jax_side import mxfp8

    t, i, o = 64, 96, 128
    x, w = bench_fp8_gemm._operands(t, i, o)
    dy = bench_fp8_gemm._operands(t, o, 1)[0]
    qx, qw, qdy = mxfp8.quantize(x), mxfp8.quantize(w), mxfp8.quantize(dy)
    a, b = {"forward": (qx, qw), "dgrad": (qdy, qw), "wgrad": (qdy, qx)}[role]
    want = np.asarray(mxfp8.matmul(a, b, role, impl="dequant_bf16_dot"), np.float32)
    pick, dims = bench_fp8_gemm.BF16_ROLES[role]
    deq = {id(x): qx, id(w): qw, id(dy): qdy}
    ops = [mxfp8.dequantize(deq[id(v)], "rowwise").astype(jax.numpy.bfloat16)
           for v in pick(x, w, dy)]
    got = np.asarray(lax.dot_general(*ops, dims, preferred_element_type=jax.numpy.float32))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert {n.rsplit(".", 1)[0] for n in bench_fp8_gemm.ROLE_SHAPES} == {"350m", "1.3b"}


def test_the_role_gemm_table_has_every_linears_three_gemms_once():
    shapes = bench_fp8_gemm.role_gemm_shapes()
    assert len(shapes) == len(set(shapes))
    # 1.3B fc2 (8192 tokens, 8192 in, 2048 out): forward (T, I, O), dgrad (T, O, I), wgrad (O, T, I)
    assert {(8192, 8192, 2048), (8192, 2048, 8192), (2048, 8192, 8192)} <= set(shapes)
    want = {f(*d) for d in bench_fp8_gemm.ROLE_SHAPES.values()
            for f in bench_fp8_gemm.ROLE_GEMM.values()}
    assert set(shapes) == want and len(bench_fp8_gemm.ROLE_SHAPES) == 8
