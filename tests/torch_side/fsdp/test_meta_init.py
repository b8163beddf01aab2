"""Meta-device initialisation (issue 34, item 2; ``torch_side.fsdp.meta_init``): a GPT built on
the meta device and sharded with ``fully_shard(..., init=GPTInit(cfg, seed))`` holds, at worlds
1-4 (in-process ranks) and under each sharding strategy, the bytes of the same GPT initialised
whole by the same rule (``materialize``) on every rank and sharded from rank 0: main weights,
gathered MXFP8 planes, the first loss. Each rank's initialisation memory is bounded by its shard
(a model whose fp32 weights alone exceed the bound). ``GPTInit`` gives every slice the bytes of
the whole. Refusals name the parameter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from common.model_config import GPTConfig
from models.init_rule import CHUNK, GPTInit
from models.torch_gpt import TorchGPT
from tests.torch_side.threaded_world import run_world
from torch_side import ShardingStrategy, fully_shard, materialize

CFG = GPTConfig(vocab_size=96, max_seq_len=32, n_layer=2, n_head=2, d_model=64, d_ff=128)
SEED = 11


def _meta_gpt(cfg: GPTConfig) -> TorchGPT:
    with torch.device("meta"):
        return TorchGPT(cfg, "mxfp8", seed=0, device="meta")


def _planes(fsdp) -> dict[str, bytes]:
    out = {}
    with fsdp.gathered_weights() as gathered:
        for name, t in gathered.items():
            tensors = [t] if isinstance(t, torch.Tensor) else [
                x for pd in t.planes.values() for x in pd]
            out[name] = b"".join(x.contiguous().view(torch.uint8).numpy().tobytes()
                                 for x in tensors)
    return out


def _shard_then_init_equals_init_then_shard(ctx, strategy) -> None:
    rule = GPTInit(CFG, SEED)
    meta = _meta_gpt(CFG)
    a = fully_shard(meta, unit_modules=meta.block_units(1), strategy=strategy, init=rule)
    whole = materialize(TorchGPT(CFG, "mxfp8", seed=ctx.rank), rule)  # seeds differ: overwritten
    b = fully_shard(whole, unit_modules=whole.block_units(1), strategy=strategy)
    sa, sb = a.full_state_dict(), b.full_state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert torch.equal(sa[name].view(torch.int32), sb[name].view(torch.int32)), name
    assert _planes(a) == _planes(b)
    tokens = torch.arange(2 * 16).reshape(2, 16) % CFG.vocab_size
    assert a(tokens, tokens).item() == b(tokens, tokens).item()
    # no initial value crossed the wire: the meta model's groups broadcast nothing
    assert not [r for r in a.wire_log() if r.label.endswith("/init")]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_then_init_equals_init_then_shard(world):
    run_world(world, _shard_then_init_equals_init_then_shard, ShardingStrategy.OPTIM_GRADS_PARAMS)


@pytest.mark.parametrize("strategy", [ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM_GRADS])
def test_every_strategy_at_world_2(strategy):
    run_world(2, _shard_then_init_equals_init_then_shard, strategy)


def test_any_slice_of_the_rule_is_the_slice_of_the_whole():
    rule = GPTInit(CFG, SEED)
    shape = (3, CHUNK // 2 + 5)  # a slice across the rule's chunk boundary
    n = shape[0] * shape[1]
    whole = torch.empty(n)
    rule.fill("h_0.mlp.fc.weight", shape, 0, whole)
    for start, stop in ((0, 7), (CHUNK - 3, CHUNK + 11), (n - 5, n), (123, n)):
        part = torch.empty(stop - start)
        rule.fill("h_0.mlp.fc.weight", shape, start, part)
        assert torch.equal(part.view(torch.int32), whole[start:stop].view(torch.int32))
    assert abs(whole.mean().item()) < 1e-4 and abs(whole.std().item() - CFG.init_std) < 1e-4
    other = torch.empty(n)
    rule.fill("h_1.mlp.fc.weight", shape, 0, other)  # another parameter: other values
    assert not torch.equal(other, whole)
    ln = torch.empty(4)
    rule.fill("h_0.ln_1.weight", (64,), 8, ln)
    assert torch.equal(ln, torch.ones(4))


def _held_bytes(groups) -> int:
    """Bytes of the distinct tensor storages the groups' buffers hold (main, main_grad, model
    weight planes, scales), each storage once: the MXFP8 groups' sharded planes are views of
    their batch's one images array (GroupBuffers.refresh_from keeps it)."""
    seen: dict[int, int] = {}
    for group in groups:
        for value in vars(group._buffers).values():
            tensors = value.values() if isinstance(value, dict) else [value]
            for t in tensors:
                if isinstance(t, torch.Tensor) and not t.is_meta:
                    storage = t.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class _Recording(GPTInit):
    """GPTInit that records the largest piece it was asked to fill."""

    def __init__(self, cfg: GPTConfig, seed: int) -> None:
        super().__init__(cfg, seed)
        self.largest = 0

    def fill(self, name, shape, start, out) -> None:
        self.largest = max(self.largest, out.numel())
        super().fill(name, shape, start, out)


BIG = GPTConfig(vocab_size=2048, max_seq_len=256, n_layer=5, n_head=8, d_model=768, d_ff=3072)
WORLD = 4


def _build_big(ctx, out) -> None:
    rule = _Recording(BIG, SEED)
    meta = _meta_gpt(BIG)
    fsdp = fully_shard(meta, unit_modules=meta.block_units(1), init=rule)
    groups = fsdp.param_groups
    shard = max(g.layout.shard_numel for g in groups)
    module_bytes = sum(p.untyped_storage().nbytes() for p in meta.parameters())
    assert module_bytes < 2**20, f"the module's parameters hold {module_bytes} bytes"
    out[ctx.rank] = (rule.largest, shard, _held_bytes(groups),
                     sum(p.numel for g in groups for p in g.main_pieces()))


def test_initialisation_memory_is_bounded_by_the_shard():
    # What a rank allocates while it initialises: FSDP's own buffers for its shard (fp32 main
    # weights and gradients, MXFP8 planes and scales: about 2.6 bytes of fp32 per element of the
    # shard) and the rule's temporaries (CHUNK elements at a time); the rule is only ever asked
    # for pieces of the rank's shard. The whole model (fp32) would not fit one rank's bound.
    numel = sum(s.numel() for s in _meta_gpt(BIG).parameters())
    full_fp32 = 4 * numel
    per_rank_bound = 3 * full_fp32 // WORLD + 100 * CHUNK  # 3 fp32 shards + the rule's chunk
    assert full_fp32 > per_rank_bound
    out: dict[int, tuple[int, int, int, int]] = {}
    run_world(WORLD, _build_big, out)
    assert sum(o[3] for o in out.values()) == numel  # the shards cover the model once
    for rank, (largest, shard, held, _) in sorted(out.items()):
        assert largest <= shard, f"rank {rank} was asked for {largest} elements at once"
        assert held + 100 * CHUNK <= per_rank_bound, (
            f"rank {rank} holds {held / 2**20:.0f} MiB after initialising its shard of a "
            f"{full_fp32 / 2**20:.0f} MiB model (bound {per_rank_bound / 2**20:.0f} MiB)")


class _WithMetaBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64, bias=False)
        self.register_buffer("mask", torch.ones(4))


def _refusals(ctx) -> None:
    rule = GPTInit(CFG, SEED)
    with pytest.raises(ValueError, match="'wte.weight' is on the meta device; pass init="):
        fully_shard(_meta_gpt(CFG))
    with pytest.raises(ValueError, match="this model's parameters are real"):
        fully_shard(TorchGPT(CFG, "mxfp8", seed=0), init=rule)
    mixed = _meta_gpt(CFG)
    mixed.lm_head.weight = nn.Parameter(torch.zeros(CFG.vocab_size, CFG.d_model))
    with pytest.raises(ValueError, match="is on the meta device but 'lm_head.weight' is not"):
        fully_shard(mixed, init=rule)
    with torch.device("meta"):
        buffered = _WithMetaBuffer()
    with pytest.raises(ValueError, match="buffer 'mask' is on the meta device"):
        fully_shard(buffered, init=rule)
    with pytest.raises(TypeError, match="init must have fill"):
        fully_shard(_meta_gpt(CFG), init=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="materialize: parameter 'wte.weight' is on the meta"):
        materialize(_meta_gpt(CFG), rule)


def test_refusals_name_the_parameter():
    run_world(1, _refusals)
