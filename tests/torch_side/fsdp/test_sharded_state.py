"""Sharded state as a library API (``torch_side.fsdp.sharded_state``): ``FSDPModel.sharded_state()``
and ``FSDPOptimizer.sharded_state()`` save and load their own state.

- Keys are structured and formatted in one place: ``key_text`` / ``parse_key`` round-trip, and
  every key a part writes matches the part's schema.
- In this process (one rank): save -> load restores main weights and optimizer state bit for bit,
  re-derives the MXFP8 planes identical to the saved model's, and reads pieces cut at other
  offsets (another world size) by overlap; a checkpoint of another model, another optimizer or
  with a missing piece is refused with nothing restored.
- Two ranks (threads of this process, ``run_ranks``) save (ZeRO-3, and ``no_shard``, whose
  replicated main weights are written once), 1 rank loads: the same main weights and optimizer
  state, planes re-derived.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.torch_side.threaded_world import run_ranks
from tests.torch_side.toy_models import Block, make_batch, make_net, mse
from torch_side import FSDPOptimizer, ShardingStrategy, fully_shard
from torch_side.checkpoint.sharded_files import (
    CheckpointError,
    ShardedReader,
    schema_dtype,
    write_step,
)
from torch_side.fsdp.sharded_state import (
    MainKey,
    OptimKey,
    OptimScalarKey,
    key_text,
    load_parts,
    parse_key,
    save_parts,
)


def _wrapped(strategy=ShardingStrategy.OPTIM_GRADS_PARAMS, lr: float = 1e-2):
    fsdp = fully_shard(make_net(0), unit_modules=(Block,), strategy=strategy)
    return fsdp, FSDPOptimizer(fsdp, torch.optim.AdamW, lr=lr)


def _train_one_step(fsdp, opt, seed: int) -> None:
    x, y = make_batch(seed, 32)
    mse(fsdp(x), y).backward()
    opt.step()
    opt.zero_grad()


def _parts(fsdp, opt):
    return [fsdp.sharded_state(), opt.sharded_state()]


def _save(fsdp, opt, path: Path, step: int = 1) -> Path:
    save_parts(path, _parts(fsdp, opt), run_id="test-run", step=step)
    return path


def _snapshot(fsdp, opt) -> dict[str, torch.Tensor]:
    """Main weights, optimizer states and the model weight planes of every group."""
    out = {}
    for g in fsdp.param_groups:
        out[f"{g.label}/main"] = g.main.clone()
        for k, v in opt.optimizer.state.get(g.main, {}).items():
            out[f"{g.label}/{k}"] = v.clone()
        for plane, buf in g.model.items():
            out[f"{g.label}/plane/{plane}"] = buf.clone()
        for plane, buf in g.scale_buffers.items():
            out[f"{g.label}/scales/{plane}"] = buf.clone()
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def trained(single_rank_world):
    fsdp, opt = _wrapped()
    _train_one_step(fsdp, opt, seed=1)
    _train_one_step(fsdp, opt, seed=2)
    return fsdp, opt


# ------------------------------------------------------------------------------------ keys


@pytest.mark.parametrize("key", [MainKey("blocks.0.mlp.fc1.weight", 4096),
                                 OptimKey("exp_avg_sq", "head.bias", 0),
                                 OptimScalarKey("step", "blocks.1/mxfp8_e4m3/dp")])
def test_keys_format_in_one_place_and_parse_back(key):
    text = key_text(key)
    assert text.startswith(type(key).PREFIX + "/")
    assert parse_key(text, [MainKey, OptimKey, OptimScalarKey]) == key


@pytest.mark.parametrize("text", ["main/w", "main/w/x", "main/w/1/2", "rng/0/torch", "main"])
def test_malformed_or_foreign_keys_parse_to_none(text):
    assert parse_key(text, [MainKey, OptimKey]) is None


def test_every_key_a_part_writes_matches_its_schema(trained):
    for part in _parts(*trained):
        entries = part.state_entries()
        assert entries
        for text in entries:
            assert schema_dtype(part.schema, text) is not None, text
            assert parse_key(text, [MainKey, OptimKey, OptimScalarKey]) is not None, text


# -------------------------------------------------------------------------- save and load


def test_round_trip_is_bit_exact_and_rederives_the_planes(trained, tmp_path):
    fsdp, opt = trained
    path = _save(fsdp, opt, tmp_path / "step_1")
    fresh, fresh_opt = _wrapped()  # initial weights, no optimizer state yet
    assert not _same(_snapshot(fresh, fresh_opt), _snapshot(fsdp, opt))
    meta = load_parts(path, _parts(fresh, fresh_opt))
    assert meta["step"] == 1 and meta["optimizer"] == "AdamW"
    assert _same(_snapshot(fresh, fresh_opt), _snapshot(fsdp, opt))
    # and training continues identically from there
    _train_one_step(fsdp, opt, seed=3)
    _train_one_step(fresh, fresh_opt, seed=3)
    assert _same(_snapshot(fresh, fresh_opt), _snapshot(fsdp, opt))


def test_a_fused_optimizer_resumes_with_its_step_counts_where_torch_keeps_them(
        single_rank_world, tmp_path):
    """Torch's fused AdamW (what mxfp8-train steps on CUDA) reads its step counts on the
    parameters' device; the restored ones sit where ``Optimizer.load_state_dict`` puts them
    (on CUDA a CPU step made the fused kernel fail), and training continues identically. Here
    both places are the CPU; the CUDA half runs in ``scripts/gpu/reliability.sh resume``."""
    def fused():
        fsdp = fully_shard(make_net(0), unit_modules=(Block,))
        return fsdp, FSDPOptimizer(fsdp, torch.optim.AdamW, lr=1e-2, fused=True)

    fsdp, opt = fused()
    _train_one_step(fsdp, opt, seed=1)
    path = _save(fsdp, opt, tmp_path / "step_1")
    fresh, fresh_opt = fused()
    load_parts(path, _parts(fresh, fresh_opt))
    by_torch = torch.optim.AdamW([g.main.detach().clone() for g in opt.groups], fused=True)
    by_torch.load_state_dict(opt.optimizer.state_dict())
    for g, want in zip(fresh_opt.groups, by_torch.state.values(), strict=True):
        step = fresh_opt.optimizer.state[g.main]["step"]
        assert (step.device, step.dtype) == (want["step"].device, want["step"].dtype), g.label
    assert _same(_snapshot(fresh, fresh_opt), _snapshot(fsdp, opt))
    _train_one_step(fsdp, opt, seed=2)
    _train_one_step(fresh, fresh_opt, seed=2)
    assert _same(_snapshot(fresh, fresh_opt), _snapshot(fsdp, opt))


def test_pieces_cut_at_other_offsets_are_read_by_overlap(trained, tmp_path):
    """What a rank of another world size sees: saved pieces split where this rank's are not."""
    fsdp, opt = trained
    whole = _save(fsdp, opt, tmp_path / "whole")
    split = {}
    with ShardedReader(whole, {k: v for p in _parts(fsdp, opt) for k, v in p.schema.items()}) as r:
        meta = r.meta
        for text in r.entries:
            value, key = r.read(text), parse_key(text, [MainKey, OptimKey])
            if key is None or value.numel() < 3:
                split[text] = value
                continue
            cut = value.numel() // 3
            split[text] = value[:cut]
            split[key_text(key._replace(offset=key.offset + cut))] = value[cut:]
    write_step(tmp_path / "cut", split, run_id="cut", step=1, schema=dict(
        p for part in _parts(fsdp, opt) for p in part.schema.items()),
        fields={k: meta[k] for k in ("params", "optimizer")})
    fresh, fresh_opt = _wrapped()
    load_parts(tmp_path / "cut", _parts(fresh, fresh_opt))
    assert _same(_snapshot(fresh, fresh_opt), _snapshot(fsdp, opt))


def _refused(path: Path, parts_of, match: str) -> None:
    fresh, fresh_opt = _wrapped()
    before = _snapshot(fresh, fresh_opt)
    with pytest.raises(CheckpointError, match=match):
        load_parts(path, parts_of(fresh, fresh_opt))
    assert _same(_snapshot(fresh, fresh_opt), before)  # nothing restored


def test_another_model_is_refused_naming_the_parameters(trained, tmp_path):
    other = fully_shard(make_net(0, n_blocks=1), unit_modules=(Block,))
    save_parts(tmp_path, [other.sharded_state()], run_id="other", step=1)
    _refused(tmp_path, lambda m, o: [m.sharded_state()],
             r"meta\.json: parameters differ from this model's \(first: \['blocks\.1\.")


def test_another_optimizer_is_refused(trained, tmp_path):
    fsdp, _ = trained
    sgd = FSDPOptimizer(fsdp, torch.optim.SGD, lr=0.1)
    save_parts(tmp_path, [fsdp.sharded_state(), sgd.sharded_state()], run_id="sgd", step=1)
    _refused(tmp_path, _parts, r"saved from 'SGD', this optimizer is 'AdamW'")


def test_a_missing_optimizer_piece_is_refused(trained, tmp_path):
    fsdp, opt = trained
    tensors = {k: v for p in _parts(fsdp, opt) for k, v in p.state_entries().items()}
    dropped = next(k for k in tensors if k.startswith("optim/exp_avg_sq/"))
    del tensors[dropped]
    key = parse_key(dropped, [OptimKey])
    write_step(tmp_path, tensors, run_id="holes", step=1,
               schema={k: v for p in _parts(fsdp, opt) for k, v in p.schema.items()},
               fields={k: v for p in _parts(fsdp, opt) for k, v in p.state_fields().items()})
    _refused(tmp_path, _parts, rf"the saved optimizer states 'exp_avg_sq' cover 0 of the \d+ "
                               rf"elements of '{key.param}' at offset {key.offset}")


# ------------------------------------------------------------------ another world size (slow)

STRATEGIES = (ShardingStrategy.OPTIM_GRADS_PARAMS, ShardingStrategy.NO_SHARD)


def _save_at_two(root: str) -> dict:
    """Every rank: train one step on its own batch, save; this rank's entries per strategy."""
    import torch.distributed as dist

    out = {}
    for s in STRATEGIES:
        fsdp, opt = _wrapped(s)
        _train_one_step(fsdp, opt, seed=10 + dist.get_rank())
        save_parts(f"{root}/{s.value}", _parts(fsdp, opt), run_id="two", step=1)
        out[s.value] = {k: v.clone() for p in _parts(fsdp, opt)
                        for k, v in p.state_entries().items()}
    return out


def _load_at_one(root: str) -> dict:
    """Load each 2-rank save; this rank's entries, and a forward's output next to a model given
    the same main weights directly (planes re-derived the same way)."""
    out = {}
    x, _ = make_batch(7, 32)
    for s in STRATEGIES:
        fsdp, opt = _wrapped(s)
        load_parts(f"{root}/{s.value}", _parts(fsdp, opt))
        direct, _ = _wrapped(s)
        direct.load_full_state_dict(fsdp.full_state_dict())
        with torch.no_grad():
            same_output = torch.equal(fsdp(x), direct(x))
        out[s.value] = ({k: v.clone() for p in _parts(fsdp, opt)
                         for k, v in p.state_entries().items()}, same_output)
    return out


def _full(entries: dict, kinds=(MainKey, OptimKey)) -> dict[tuple, torch.Tensor]:
    """(kind, state, param) -> the full flat tensor assembled from pieces (offsets checked)."""
    pieces: dict[tuple, list] = {}
    for text, value in entries.items():
        key = parse_key(text, kinds)
        if key is not None:
            state = getattr(key, "state", "main")
            pieces.setdefault((type(key).PREFIX, state, key.param), []).append((key.offset, value))
    out = {}
    for k, ps in pieces.items():
        ps.sort(key=lambda p: p[0])
        pos = 0
        for offset, value in ps:  # the pieces tile the parameter
            assert offset == pos, k
            pos += value.numel()
        out[k] = torch.cat([v.reshape(-1) for _, v in ps])
    return out


def test_two_ranks_save_one_rank_loads(tmp_path):
    # ranks are threads of this process (run_ranks): world 1 reuses world 2's programs
    saved = run_ranks(_save_at_two, 2, (str(tmp_path),))
    (loaded,) = run_ranks(_load_at_one, 1, (str(tmp_path),))
    for s in STRATEGIES:
        if s is ShardingStrategy.NO_SHARD:  # replicated: written once, by rank 0
            assert not [k for k in saved[1][s.value] if k.startswith(("main/", "optim/"))]
        both = {**saved[0][s.value], **saved[1][s.value]}
        entries, same_output = loaded[s.value]
        assert _full(entries).keys() == _full(both).keys()
        for k, v in _full(both).items():
            assert torch.equal(_full(entries)[k], v), (s, k)
        scalars = [k for k in both if k.startswith("optim_scalar/")]
        assert scalars and all(torch.equal(entries[k], both[k]) for k in scalars)
        assert same_output, s
