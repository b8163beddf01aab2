"""FSDP units of several modules (a ``unit_modules`` list) and their one unit program.

``fully_shard(model, unit_modules=[(model.h_0, model.h_1), ...])`` makes the listed modules one
unit (one gather, one reduction); under ``Compute.UNIT`` a unit of registered blocks runs as one
JAX program per direction (``bridge.units``: ``SpanFn``), and each block returns its own output.
Checked here, world 1 in process: losses, reduced gradients and weights after optimizer steps are
the same bytes as with one unit per block (unit and op compute, recompute, fp32 and bf16
activations, evaluation, a model that reads every block's output); the programs and collectives
per step shrink as they should; misuse is refused with a clear error. The sharded ranks against
the replicated reference: ``test_units_fsdp`` (``blocks_in_one_unit``).
"""

from __future__ import annotations

import collections

import pytest
import torch

import bridge.units as BU
from bridge.unit_bindings import binding_of
from common.model_config import GPTConfig
from jax_side import unit_program as U
from models.gpt_math import GPTHeadFn
from models.torch_gpt import Block, TorchGPT
from torch_side import FSDPOptimizer, fully_shard
from torch_side.comm.collectives import Collective

CFG = GPTConfig(vocab_size=64, max_seq_len=32, n_layer=4, n_head=2, d_model=64, d_ff=128)


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, CFG.vocab_size, (2, 33), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


class HiddenStatesGPT(TorchGPT):
    """A GPT whose loss reads every block's output: an auxiliary term over all hidden states
    and a residual from the first block's output into the last one's."""

    def forward(self, tokens, targets):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))  # (B, S, D)
        hidden = []
        for block in self.blocks:
            x = block(x)
            hidden.append(x)
        aux = sum(h.square().mean() for h in hidden)
        loss = BU.run_unit(self, GPTHeadFn(self.cfg), x + hidden[0], targets,
                           parts=("ln_f", "lm_head"))
        return loss + 0.01 * aux


class EarlyHeadGPT(TorchGPT):
    """A GPT whose head reads the third block's output: the fourth block runs, unread."""

    def forward(self, tokens, targets):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))  # (B, S, D)
        hidden = []
        for block in self.blocks:
            x = block(x)
            hidden.append(x)
        return BU.run_unit(self, GPTHeadFn(self.cfg), hidden[2], targets,
                           parts=("ln_f", "lm_head"))


def _model(k: int, compute="unit", cls=TorchGPT, **kw):
    net = cls(CFG, seed=3, compute=compute, **kw)
    return fully_shard(net, unit_modules=net.block_units(k))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _train(model, steps=2, micro_batches=1):
    """Losses of each micro-batch, then the weights after SGD steps (and the last grads)."""
    opt = FSDPOptimizer(model, torch.optim.SGD, lr=0.5)
    losses = []
    for step in range(steps):
        for mb in range(micro_batches):
            loss = model(*_batch(10 * step + mb)) / micro_batches
            loss.backward()
            losses.append(loss.detach().clone())
        grads = model.full_grads()
        opt.step()
        opt.zero_grad()
    return losses, grads, model.full_state_dict()


def _assert_same(got, want):
    (gl, gg, gw), (wl, wg, ww) = got, want
    assert [_bytes(x).tolist() for x in gl] == [_bytes(x).tolist() for x in wl], (gl, wl)
    for ours, theirs in ((gg, wg), (gw, ww)):
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert torch.equal(_bytes(ours[name]), _bytes(theirs[name])), name


@pytest.mark.parametrize(
    ("compute", "kw"),
    [("unit", {}), ("unit", {"activations": "bf16", "recompute": True}), ("op", {})],
    ids=["unit", "unit-bf16-recompute", "op"],
)
def test_a_unit_of_several_blocks_trains_to_the_same_bytes(single_rank_world, compute, kw):
    # two units of two blocks (one program shared by both) and, for the default, one of four;
    # two micro-batches where the default runs, one elsewhere (compiles dominate the time)
    mb = 2 if compute == "unit" and not kw else 1
    want = _train(_model(1, compute, **kw), micro_batches=mb)
    for k in (2, 4) if mb == 2 else (2,):
        _assert_same(_train(_model(k, compute, **kw), micro_batches=mb), want)


def _count_calls(monkeypatch, names) -> collections.Counter:
    """Count the calls of ``bridge.units``' program entry points ``names`` by (name, the
    spec's function type)."""
    calls = collections.Counter()
    for name in names:
        real = getattr(U, name)

        def wrap(*a, _real=real, _name=name, **kw):
            calls[_name, type(kw["spec"].fn).__name__] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(U, name, wrap)
    return calls


def test_one_program_per_unit_and_direction_and_one_gather_per_unit(
        single_rank_world, monkeypatch):
    calls = _count_calls(monkeypatch, ("unit_forward", "unit_backward"))
    for k, programs in ((1, 4), (2, 2), (4, 1)):
        calls.clear()
        model = _model(k)
        model.clear_wire_log()
        model(*_batch(0)).backward()
        block_fn = "GPTBlockFn" if k == 1 else "SpanFn"
        assert calls == {("unit_forward", block_fn): programs,
                         ("unit_backward", block_fn): programs,
                         ("unit_forward", "GPTHeadFn"): 1, ("unit_backward", "GPTHeadFn"): 1}, \
            (k, dict(calls))
        units = [u.name for u in model.units]
        assert len(units) == 1 + programs, units
        gathers = collections.Counter(
            r.label.split("/")[0] for r in model.wire_log() if r.op is Collective.ALL_GATHER)
        # every block unit: its rowwise planes and LayerNorm weights for the forward, the
        # colwise planes and LayerNorm weights again for the backward (one gather each)
        assert set(gathers) == set(units), gathers
        assert all(gathers[u] == gathers[units[1]] for u in units[1:]), gathers
    assert units == ["<root>", "h_0+h_1+h_2+h_3"]


@pytest.mark.parametrize(("flags", "cuda_spans"), [
    ("", True), ("--xla_gpu_autotune_level=0", True),
    ("--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0", False),
    ("--xla_gpu_deterministic_ops", False), ("--xla_gpu_deterministic_ops=false", True),
])
def test_span_programs_are_off_on_cuda_under_xla_deterministic_ops(monkeypatch, flags,
                                                                   cuda_spans):
    """XLA:GPU fails to execute a span's backward with --xla_gpu_deterministic_ops (jax 0.11.2,
    H200: IndexError raw_hash_map::at; BENCHMARKS.md): there the blocks run their own programs."""
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert BU.span_programs_run_on(torch.device("cuda")) is cuda_spans
    assert BU.span_programs_run_on(torch.device("cpu"))


def test_a_unit_whose_span_program_is_off_runs_one_program_per_block_same_bytes(
        single_rank_world, monkeypatch):
    """Where span programs are off (CUDA under deterministic ops), a unit of four blocks runs
    each block's program inside the one FSDP unit: one gather per unit, the bytes of one unit
    per block."""
    want = _train(_model(1))
    monkeypatch.setattr(BU, "span_programs_run_on", lambda device: False)
    calls = _count_calls(monkeypatch, ("unit_forward", "unit_backward"))
    model = _model(4)
    assert [u.name for u in model.units] == ["<root>", "h_0+h_1+h_2+h_3"]
    got = _train(model)
    assert calls == {("unit_forward", "GPTBlockFn"): 8, ("unit_backward", "GPTBlockFn"): 8,
                     ("unit_forward", "GPTHeadFn"): 2, ("unit_backward", "GPTHeadFn"): 2}, calls
    _assert_same(got, want)


def test_every_block_of_a_unit_returns_its_own_output(single_rank_world):
    # a model reading h_1 .. h_4 trains to the same bytes with 2 or 3 blocks per unit (units
    # (h_0, h_1, h_2) and (h_3,)) as with one, and evaluates to the training forward's bytes
    want = _train(_model(1, cls=HiddenStatesGPT))
    for k in (2, 3):
        _assert_same(_train(_model(k, cls=HiddenStatesGPT)), want)
    for k in (1, 2, 3):
        with torch.no_grad():
            evaluated = _model(k, cls=HiddenStatesGPT)(*_batch(0))
        assert torch.equal(_bytes(evaluated), _bytes(want[0][0])), k


def test_a_unit_whose_last_output_is_not_read_trains_to_the_same_bytes(single_rank_world):
    # the unit (h_2, h_3): a gradient for h_2's output only (the backward takes zeros for h_3's)
    _assert_same(_train(_model(2, cls=EarlyHeadGPT)), _train(_model(1, cls=EarlyHeadGPT)))


def test_evaluation_runs_the_training_forward_program(single_rank_world, monkeypatch):
    # no_grad runs unit_forward, as training does (a forward-only program may round bf16
    # elsewhere: XLA's excess precision), dropping its residuals; the unit's blocks are one
    # program there too
    calls = _count_calls(monkeypatch, ("unit_forward", "unit_apply"))
    tokens, targets = _batch(0)
    with torch.no_grad():
        want = _model(1)(tokens, targets)
        got = _model(2)(tokens, targets)
    assert torch.equal(_bytes(got), _bytes(want))
    assert calls == {("unit_forward", "GPTBlockFn"): 4, ("unit_forward", "SpanFn"): 2,
                     ("unit_forward", "GPTHeadFn"): 2}, dict(calls)
    assert torch.equal(_bytes(_model(2)(tokens, targets)), _bytes(want))


def test_a_later_block_of_the_unit_called_alone_is_refused(single_rank_world):
    model = _model(2)
    x = torch.randn(2, 32, CFG.d_model)
    with pytest.raises(RuntimeError, match="block 1 of an FSDP unit of 2 blocks.*without the "
                                           "unit's first block"):
        model.module.h_1(x)
    y = model.module.h_0(x)  # runs h_0 and h_1 in one program
    with pytest.raises(RuntimeError, match="on another tensor than that program's output"):
        model.module.h_1(y + 0)
    assert not torch.equal(model.module.h_1(y), y)  # h_1's own output, not h_0's
    with torch.no_grad():
        y = model.module.h_0(x)
    with pytest.raises(RuntimeError, match="with gradients on, the first block with them off"):
        model.module.h_1(y)


def test_a_block_skipped_after_its_unit_program_ran_is_caught_at_backward(single_rank_world):
    model = _model(2)
    net = model.module
    x = torch.randn(2, 32, CFG.d_model, requires_grad=True)
    y = net.h_1(net.h_0(x))
    y = net.h_2(y)  # h_3 is never called, but the program of h_2+h_3 applied it
    with pytest.raises(RuntimeError, match="1 of the others were not called on its output"):
        y.float().sum().backward()


def test_a_forward_aborted_between_the_blocks_of_a_unit_leaves_no_trace(single_rank_world):
    model = _model(2)
    h_1 = model.module.h_1

    span = binding_of(h_1).span
    assert span is binding_of(model.module.h_0).span and span.members == (model.module.h_0, h_1)

    def interrupt(module, args):
        assert span.run is not None  # h_0's program ran h_0 and h_1
        raise KeyboardInterrupt("interrupted between the blocks")

    handle = h_1.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(*_batch(0))
    handle.remove()
    assert span.run is None  # FSDP dropped the aborted forward's run
    loss = model(*_batch(1))
    loss.backward()
    want = _model(1)(*_batch(1))
    assert torch.equal(_bytes(loss), _bytes(want))


def test_bad_unit_lists_are_refused_by_name(single_rank_world):
    net = TorchGPT(CFG, seed=3)
    with pytest.raises(ValueError, match=r"module 'h_0' is in two units \(h_0 and h_0\+h_1\)"):
        fully_shard(net, unit_modules=[Block, (net.h_0, net.h_1)])
    with pytest.raises(ValueError, match="lists 'h_0.attn' inside its module 'h_0'"):
        fully_shard(net, unit_modules=[(net.h_0, net.h_0.attn)])
    with pytest.raises(ValueError, match=r"holds TorchGPT \(the wrapped root\)"):
        fully_shard(net, unit_modules=[(net, net.h_0)])
    other = TorchGPT(CFG, seed=3)
    with pytest.raises(ValueError, match="expected submodule instances of the wrapped TorchGPT"):
        fully_shard(net, unit_modules=[(other.h_0,)])
    with pytest.raises(ValueError, match="a unit_modules list is empty"):
        fully_shard(net, unit_modules=[()])
    with pytest.raises(TypeError, match="unit_modules must be a list or tuple"):
        fully_shard(net, unit_modules=Block)
