"""The FSDP2 baseline of ``bench_train_step`` (``benchmarks.plain_gpt``) computes this project's
GPT from the same initial weights, and the benchmark's GPU-time categories name the kernels the
profiles show."""

from __future__ import annotations

import re

import pytest
import torch

from benchmarks.bench_train_step import CATEGORY_NAMES, _parse_run, kernel_category
from benchmarks.plain_gpt import PlainGPT, from_twin
from common.model_config import SMALL
from models.torch_gpt import TorchGPT, cross_entropy


def test_the_plain_gpt_from_the_twin_computes_the_twins_loss():
    plain = from_twin(SMALL, seed=3, device="cpu")
    twin = TorchGPT(SMALL, seed=3, linear_impl="torch")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 65), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    got, want = plain(x, y), cross_entropy(twin(x), y)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32: summation order only
    got.backward()
    want.backward()
    for (name, p), (_, q) in zip(plain.named_parameters(), twin.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_plain_gpt_runs_in_the_dtype_of_its_parameters():
    plain = PlainGPT(SMALL).to(torch.bfloat16)
    tokens = torch.zeros((1, 8), dtype=torch.long)
    loss = plain(tokens, tokens)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)  # fp32 logits for the loss


@pytest.mark.parametrize(("kernel", "category"), [
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "collectives"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", "attention"),
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("gemm_fusion_dot_123", "gemm"),
    ("triton_tem_fused_mm_4", "gemm"),
    ("triton_red_fused_abs_amax_clamp_0", "quantize"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
     "optimizer"),
    ("loop_convert_fusion_7", "copies"),
    ("wrapped_concatenate", "copies"),
    ("Memcpy DtoD (Device -> Device)", "copies"),
    ("void at::native::vectorized_layer_norm_kernel<float, float>", "other"),
])
def test_kernels_fall_in_the_category_their_name_says(kernel, category):
    assert category in CATEGORY_NAMES
    assert kernel_category(kernel) == category


def test_pytorch_runs_take_no_unit_count():
    assert _parse_run("mxfp8:u4") == ("mxfp8", 4)
    assert _parse_run("fsdp2-compile") == ("fsdp2-compile", 1)
    for bad in ("fsdp2:u2", "torchao:u4", "mxfp8:u0", "nope"):
        with pytest.raises(ValueError):
            _parse_run(bad)


def test_recompute_is_a_suffix_of_this_projects_runs_only():
    from benchmarks.bench_train_step import _run_spec

    assert _run_spec("mxfp8:u4:r") == ("mxfp8", 4, True)
    assert _run_spec("bf16:r") == ("bf16", 1, True)
    assert _run_spec("mxfp8:u4") == ("mxfp8", 4, False)
    assert _parse_run("mxfp8:u4:r") == ("mxfp8", 4)
    for bad in ("fsdp2:r", "torchao:r", "mxfp8-op:u2:r"):  # named, why, and what to do
        with pytest.raises(ValueError, match=re.escape(bad) + ".*runs no unit programs, drop ':r'"):
            _run_spec(bad)
    from benchmarks.bench_train_step import _whole_qkv

    assert _run_spec("mxfp8:u4:r:qkv1") == ("mxfp8", 4, True) and _whole_qkv("mxfp8:u4:r:qkv1")
    assert _run_spec("bf16:qkv1") == ("bf16", 1, False) and not _whole_qkv("mxfp8:u4")
    from benchmarks.bench_train_step import _switches

    assert _run_spec("mxfp8:u4:gelu-in") == ("mxfp8", 4, False)
    assert _switches("mxfp8:u4:gelu-in") == ("mxfp8:u4", {"GELU_IN_LINEAR"})
    for run in ("mxfp8:u4:r:qkv1:gelu-in", "mxfp8:u4:r:gelu-in:qkv1"):
        assert _switches(run) == ("mxfp8:u4:r", {"GELU_IN_LINEAR", "QKV_PARTS"})
        assert _run_spec(run) == ("mxfp8", 4, True) and _whole_qkv(run)
    assert not _whole_qkv("mxfp8:u4:gelu-in")
    assert _switches("mxfp8:u4:qkv1:pairs") == ("mxfp8:u4", {"PAIRS", "QKV_PARTS"})
    assert _run_spec("mxfp8:u4:pairs") == ("mxfp8", 4, False)
    assert _switches("mxfp8:u4:packed:pairs") == ("mxfp8:u4", {"PAIRS", "PACKED"})
    assert _switches("mxfp8:u4:given") == ("mxfp8:u4", {"GIVEN"})
    assert _switches("mxfp8:u4:gelu-apart") == ("mxfp8:u4", {"GELU_IN_GEMM"})
    assert _switches("mxfp8:u4:gelu-in:gelu-apart") == ("mxfp8:u4",
                                                        {"GELU_IN_LINEAR", "GELU_IN_GEMM"})
    assert _run_spec("mxfp8:u4:r:gelu-apart") == ("mxfp8", 4, True)
    assert _switches("mxfp8:u4:graphs") == ("mxfp8:u4", {"COMMAND_BUFFERS"})
    assert _switches("mxfp8:u4:graphs:streams") == ("mxfp8:u4", {"COMMAND_BUFFERS",
                                                                 "COMM_STREAMS"})
    for bad in ("fsdp2:qkv1", "mxfp8-op:qkv1", "torchao:gelu-in", "fsdp2:pairs", "fsdp2:given",
                "fsdp2:gelu-apart", "torchao:graphs", "fsdp2:streams"):
        with pytest.raises(ValueError, match=re.escape(bad) + ".*drop them"):
            _run_spec(bad)
    for bad in ("mxfp8:r:u4", "mxfp8:u4:rr", "mxfp8:u:r", "fsdp2:u2:r", "nope:r",
                "mxfp8:qkv1:r", "mxfp8:gelu-in:gelu-in", "mxfp8:gelu-in:r"):
        with pytest.raises(ValueError, match=f"unknown run {re.escape(repr(bad))}: expected .*"
                                             "':u<N>'.*then ':r'.*':gelu-in'.*'mxfp8:u4:r'"):
            _run_spec(bad)


def test_the_kernel_listing_gives_each_category_its_total_and_top_kernels():
    from benchmarks.bench_train_step import _kernels_by_category

    text = _kernels_by_category({"gemm_fusion_dot_1": [3.0, 4], "nvjet_a": [5.0, 2],
                                 "memcpy128": [1.5, 10], "loop_add_fusion": [0.25, 1]}, top=1)
    assert text.splitlines() == ["gemm: 8.0 ms", "      5.00 ms     2x  nvjet_a",
                                 "copies: 1.5 ms", "      1.50 ms    10x  memcpy128",
                                 "other: 0.2 ms", "      0.25 ms     1x  loop_add_fusion"]


def test_a_runs_memory_is_its_own_and_an_unmeasurable_jax_peak_says_so():
    from benchmarks.bench_train_step import _Memory, _peak_cell

    assert _Memory("cpu").peaks() == (0.0, 0.0, (0.0, 0.0))
    assert _peak_cell({"peak_torch_gib": 25.94, "peak_jax_gib": 19.6,
                       "held_gib": [0.01, 0.0]}) == "25.9+19.6"
    assert _peak_cell({"peak_torch_gib": 33.0, "peak_jax_gib": None,
                       "held_gib": [19.4, 0.8]}) == "33.0+? (19.4+0.8 held before)"
