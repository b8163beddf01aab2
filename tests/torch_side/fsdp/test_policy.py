"""Mixed-precision policy, strategies and the entry point's checks (no processes spawned)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.formats import FORMATS, RegisteredFormat
from torch_side import (
    BucketAllocator,
    MixedPrecisionPolicy,
    ShardingStrategy,
    UnalignedLinear,
    WeightFormat,
    fully_shard,
)
from torch_side.fsdp.strategy import STRATEGY_FACTS


def test_policy_is_frozen_and_validated():
    policy = MixedPrecisionPolicy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.other_format = WeightFormat.BF16
    with pytest.raises(ValueError, match="cannot be block-scaled"):
        MixedPrecisionPolicy(other_format=WeightFormat.MXFP8_E4M3)
    with pytest.raises(ValueError, match="main weights are fp32"):
        MixedPrecisionPolicy(main_param_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="grad_comm_dtype"):
        MixedPrecisionPolicy(grad_comm_dtype=torch.float16)
    with pytest.raises(TypeError, match="expected a WeightFormat"):
        MixedPrecisionPolicy(linear_weight_format="mxfp8")
    with pytest.raises(TypeError, match="or a format registered with"):
        MixedPrecisionPolicy(linear_weight_format=RegisteredFormat("not_registered"))


def test_weight_format_routing_and_helpers():
    policy = MixedPrecisionPolicy(other_format=WeightFormat.BF16)
    w = torch.empty(64, 96)
    assert policy.weight_format("fc.weight", w, block_scaled=True) is WeightFormat.MXFP8_E4M3
    assert policy.weight_format("ln.weight", torch.empty(64), False) is WeightFormat.BF16
    with pytest.raises(ValueError, match=r"'odd.weight' of shape \(40, 64\)"):
        policy.weight_format("odd.weight", torch.empty(40, 64), True)
    fallback = dataclasses.replace(policy, unaligned_linear=UnalignedLinear.FALLBACK)
    assert fallback.weight_format("odd.weight", torch.empty(40, 64), True) is WeightFormat.BF16
    assert MixedPrecisionPolicy.model_weight_buffer_dtype(WeightFormat.MXFP8_E4M3) == torch.uint8
    assert MixedPrecisionPolicy.requires_backward_specific_weight(WeightFormat.MXFP8_E4M3)
    assert not MixedPrecisionPolicy.requires_backward_specific_weight(WeightFormat.BF16)
    hp = MixedPrecisionPolicy.high_precision_value(WeightFormat.MXFP8_E4M3, torch.ones(2))
    assert hp.dtype == torch.bfloat16
    assert set(FORMATS) == set(WeightFormat)


def test_strategies_parse_and_table():
    assert ShardingStrategy.parse("optim_grads") is ShardingStrategy.OPTIM_GRADS
    with pytest.raises(ValueError, match="unknown sharding strategy 'zero4'"):
        ShardingStrategy.parse("zero4")
    assert set(STRATEGY_FACTS) == set(ShardingStrategy)
    assert STRATEGY_FACTS[ShardingStrategy.OPTIM_GRADS_PARAMS].model_weights_sharded


def test_fully_shard_needs_an_initialised_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        fully_shard(torch.nn.Linear(4, 4))


def test_bucket_allocator_counts_and_refuses_double_allocation():
    alloc = BucketAllocator()
    alloc.allocate("u", "rowwise", 100, torch.uint8, torch.device("cpu"))
    alloc.allocate("u", "grad", 10, torch.float32, torch.device("cpu"))
    assert alloc.live_bytes == 140 and alloc.peak_bytes == 140
    with pytest.raises(RuntimeError, match="still live"):
        alloc.allocate("u", "rowwise", 100, torch.uint8, torch.device("cpu"))
    alloc.free("u", "rowwise")
    assert (
        alloc.live_bytes == 40 and alloc.peak_bytes == 140 and alloc.live_keys() == [("u", "grad")]
    )


def test_the_gather_mode_is_an_explicit_policy_field():
    from torch_side import GatherMode

    assert MixedPrecisionPolicy().gather is GatherMode.MXFP8
    assert MixedPrecisionPolicy(gather="bf16").gather is GatherMode.BF16
    with pytest.raises(ValueError, match="a bf16 gather replaces the all-gather of block-scaled"):
        MixedPrecisionPolicy(linear_weight_format=WeightFormat.BF16, gather=GatherMode.BF16)
    with pytest.raises(ValueError, match="unknown MixedPrecisionPolicy.gather 'int4'"):
        MixedPrecisionPolicy(gather="int4")
