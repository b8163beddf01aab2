"""Sharding strategies as an enum with one table of what each one shards (DESIGN.md 5)."""

from __future__ import annotations

import dataclasses
import enum

from common.enums import Parseable

__all__ = ["STRATEGY_FACTS", "ShardingStrategy", "StrategyFacts"]


class ShardingStrategy(Parseable, enum.Enum, what="sharding strategy"):
    """Megatron-FSDP's ``data_parallel_sharding_strategy`` values."""

    NO_SHARD = "no_shard"  # DDP: everything replicated, gradients all-reduced
    OPTIM = "optim"  # ZeRO-1: main weights / optimizer state sharded
    OPTIM_GRADS = "optim_grads"  # ZeRO-2: + main gradients sharded (reduce-scatter)
    OPTIM_GRADS_PARAMS = "optim_grads_params"  # ZeRO-3: + model weights sharded (all-gather)


@dataclasses.dataclass(frozen=True)
class StrategyFacts:
    main_weights_sharded: bool  # fp32 main weights + optimizer state hold 1/DP per rank
    grads_sharded: bool  # reduce-scatter into a main-grad shard (else all-reduce, full buffer)
    model_weights_sharded: bool  # model weight buffers hold 1/DP; unshard all-gathers them


STRATEGY_FACTS: dict[ShardingStrategy, StrategyFacts] = {
    ShardingStrategy.NO_SHARD: StrategyFacts(False, False, False),
    ShardingStrategy.OPTIM: StrategyFacts(True, False, False),
    ShardingStrategy.OPTIM_GRADS: StrategyFacts(True, True, False),
    ShardingStrategy.OPTIM_GRADS_PARAMS: StrategyFacts(True, True, True),
}
