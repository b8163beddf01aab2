"""HSDP (``torch_side.fsdp.hybrid_mesh``): ``fully_shard(mesh=2-D DeviceMesh)`` runs each strategy
inside the shard groups and all-reduces gradients across the replicas.

- Training matches the replicated single-process reference (``test_training_parity``'s
  ``_train_and_compare``: the same net, global batch and optimizer) at world 4 as 2 replicas x 2
  shards for every strategy (ZeRO-3 and ``no_shard`` in the fast suite), and as 4 x 1 and 1 x 4;
  at world 8 as 2 x 4 and 4 x 2 (slow; in-process worlds of 8 threads).
- The bytes of every collective: MXFP8 all-gathers (1 byte per element) and gradient
  reduce-scatters only over the shard group, one all-reduce of the reduced shard (fp32) per
  group and micro-batch over the replicate group, nothing else across replicas in a step.
- The replicas hold the same bytes: main weights, MXFP8 planes and scales (the distributed
  quantization over a shard group writes the bytes of a plain run at that size), optimizer state.
- Initial values come from global rank 0 (broadcast over both groups); ``InitSync.VERIFY`` raises
  on every rank together, naming the ranks that differ.
- A checkpoint saved at 2 x 2 (replica 0 writes) loads at 4 x 1 and at a plain world of 2 with
  the same main weights and optimizer state.
- Bad meshes are refused by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.torch_side.fsdp.full_state import full_optimizer_state
from tests.torch_side.test_training_parity import _train_and_compare
from tests.torch_side.threaded_world import run_world
from tests.torch_side.toy_models import Block, make_batch, make_net, mse
from torch_side import (
    Collective,
    FSDPOptimizer,
    InitSync,
    ShardingStrategy,
    fully_shard,
)
from torch_side.checkpoint.step_dirs import rank_files
from torch_side.fsdp.hybrid_mesh import hsdp_mesh
from torch_side.fsdp.sharded_state import load_parts, save_parts

MESH_NAMES = ("replicate", "shard")
T = 32  # tokens per rank


def _mesh(replicas: int):
    return init_device_mesh("cpu", (replicas, dist.get_world_size() // replicas),
                            mesh_dim_names=MESH_NAMES)


# --------------------------------------------------------------- against the reference


@pytest.mark.parametrize(
    "strategy",
    [ShardingStrategy.OPTIM_GRADS_PARAMS, ShardingStrategy.NO_SHARD,
     pytest.param(ShardingStrategy.OPTIM, marks=pytest.mark.slow),
     pytest.param(ShardingStrategy.OPTIM_GRADS, marks=pytest.mark.slow)],
    ids=lambda s: s.value,
)
def test_two_replicas_of_two_shards_match_the_replicated_reference(strategy):
    run_world(4, lambda ctx: _train_and_compare(ctx, strategy, replicas=2))


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [4, 1], ids=["4x1", "1x4"])
def test_other_mesh_shapes_match_the_replicated_reference(replicas):
    run_world(4, lambda ctx: _train_and_compare(ctx, ShardingStrategy.OPTIM_GRADS_PARAMS,
                                                replicas=replicas))


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [2, 4], ids=["2x4", "4x2"])
def test_world_8_meshes_match_the_replicated_reference(replicas):
    run_world(8, lambda ctx: _train_and_compare(ctx, ShardingStrategy.OPTIM_GRADS_PARAMS,
                                                replicas=replicas))


# ------------------------------------------------------------------- wire and bytes


def _check_wire(model) -> None:
    """Over the replicate group: the wrap's broadcasts, then per step and gradient group one
    fp32 all-reduce of the shard's reduced gradient; over the shard group: the reduce-scatters of
    the whole padded buffer and the all-gathers, as a plain FSDP run at 2 ranks."""
    groups = {g.label: g for g in model.param_groups}
    dp, rep = model.comms["dp"], model.comms["replicate"]
    assert model.mesh_shape == (2, 2) and dp.world_size == 2 and rep.world_size == 2
    grads = [r for r in rep.records if r.label.endswith("/grad/replicas")]
    others = [r for r in rep.records if r not in grads]
    assert all(r.op is Collective.BROADCAST and r.label.endswith("/init") for r in others), others
    takes = [g for g in model.param_groups if g.takes_grads]
    assert len(grads) == 2 * len(takes), [r.label for r in grads]  # 2 steps, 1 micro-batch
    for r in grads:
        g = groups[r.label.removesuffix("/grad/replicas")]
        assert r.op is Collective.ALL_REDUCE_SUM and r.dtype == torch.float32, r
        assert r.numel == g.layout.shard_numel and r.bytes_sent == 4 * g.layout.shard_numel, r
    scatters = [r for r in dp.records if r.op is Collective.REDUCE_SCATTER]
    assert len(scatters) == len(grads), [r.label for r in scatters]
    for r in scatters:
        g = groups[r.label.removesuffix("/grad")]
        assert r.numel == g.layout.padded_numel and r.dtype == torch.float32, r
    gathers = [r for r in dp.records if r.op is Collective.ALL_GATHER]
    assert gathers and all(r.dtype in (torch.uint8, torch.float32) for r in gathers), gathers


def test_collectives_carry_the_stated_bytes_on_each_group():
    def case(ctx):
        _check_wire(_train_and_compare(ctx, ShardingStrategy.OPTIM_GRADS_PARAMS, replicas=2))

    run_world(4, case)


def _replica_bytes(model, opt) -> dict[str, bytes]:
    out = {}
    for g in model.param_groups:
        out[f"{g.label}/main"] = g.main.numpy().tobytes()
        for plane, buf in g.model.items():
            out[f"{g.label}/{plane}"] = buf.numpy().tobytes()
        for plane, buf in g.scale_buffers.items():
            out[f"{g.label}/scale/{plane}"] = buf.numpy().tobytes()
        for k, v in opt.optimizer.state.get(g.main, {}).items():
            out[f"{g.label}/{k}"] = v.numpy().tobytes()
    return out


def _train(model, opt, steps: int = 2) -> None:
    r = dist.get_rank()
    for step in range(steps):
        x, y = make_batch(100 + step, T * dist.get_world_size())
        mse(model(x[r * T:(r + 1) * T]), y[r * T:(r + 1) * T]).backward()
        opt.step()
        opt.zero_grad()


def test_replicas_hold_the_same_bytes_and_the_planes_of_a_plain_shard_group():
    """Every replica's main shard, MXFP8 planes, scales and optimizer state are byte-identical,
    and the planes are what a plain 2-rank wrap of the same main weights quantizes."""

    def case(ctx):
        torch.manual_seed(0)
        model = fully_shard(make_net(0), unit_modules=(Block,), mesh=_mesh(2))
        opt = FSDPOptimizer(model, torch.optim.AdamW, lr=1e-2, foreach=False)
        _train(model, opt)
        mine = _replica_bytes(model, opt)
        rep = model.comms["replicate"].group
        theirs: list = [None, None]
        dist.all_gather_object(theirs, mine, group=rep)
        assert theirs[0] == theirs[1], [k for k in mine if theirs[0][k] != theirs[1][k]][:3]
        # the same main weights wrapped plainly over this shard group: the same plane bytes
        full = model.full_state_dict()
        plain = fully_shard(make_net(1), unit_modules=(Block,), group=model.comms["dp"].group)
        plain.load_full_state_dict(full)
        for g, p in zip(model.param_groups, plain.param_groups, strict=True):
            for plane in g.model:
                assert torch.equal(g.model[plane], p.model[plane]), (g.label, plane)
            for plane in g.scale_buffers:
                assert torch.equal(g.scale_buffers[plane], p.scale_buffers[plane])

    run_world(4, case)


# ------------------------------------------------------------------------ initial values


def test_every_rank_starts_from_global_rank_0_values():
    def case(ctx):
        net = make_net(ctx.rank)  # every rank builds different values
        want = make_net(0).state_dict()
        model = fully_shard(net, unit_modules=(Block,), mesh=_mesh(2))
        for name, value in model.full_state_dict().items():
            assert torch.equal(value, want[name].float()), name

    run_world(4, case)


def test_verify_raises_on_every_rank_naming_the_ranks_that_differ():
    raised = {}

    def case(ctx):
        net = make_net(1 if ctx.rank == 3 else 0)  # rank 3: replica 1, shard rank 1
        with pytest.raises(ValueError) as err:
            fully_shard(net, unit_modules=(Block,), mesh=_mesh(2), init_sync=InitSync.VERIFY)
        raised[ctx.rank] = str(err.value)

    run_world(4, case)
    assert sorted(raised) == [0, 1, 2, 3]
    for text in raised.values():
        assert "on ranks [3] differs from its value on rank 0" in text, text
        assert "'dp' and 'replicate' process groups" in text, text


# ----------------------------------------------------------------------------- checkpoints


def _wrapped(mesh=None, seed: int = 0):
    model = fully_shard(make_net(seed), unit_modules=(Block,), mesh=mesh)
    return model, FSDPOptimizer(model, torch.optim.AdamW, lr=1e-2, foreach=False)


def test_a_checkpoint_saved_at_2x2_resumes_at_4x1_and_at_a_plain_world_of_2(tmp_path):
    path = tmp_path / "step_2"
    saved = {}

    def save(ctx):
        model, opt = _wrapped(_mesh(2))
        _train(model, opt)
        save_parts(path, [model.sharded_state(), opt.sharded_state()], run_id="hsdp", step=2)
        full, optim = model.full_state_dict(), full_optimizer_state(model, opt)
        if ctx.rank == 0:
            saved.update(main=full, optim=optim)
        # replicas > 0 wrote no pieces of their own
        return model.comms["replicate"].rank

    run_world(4, save)
    sizes = {r: (path / rank_files(r)[0]).stat().st_size for r in range(4)}
    assert sizes[0] > 0 and sizes[1] > 0 and sizes[2] == 0 and sizes[3] == 0, sizes

    def load(mesh_replicas):
        def case(ctx):
            mesh = _mesh(mesh_replicas) if mesh_replicas else None
            model, opt = _wrapped(mesh, seed=5)  # other initial values
            _train(model, opt, steps=1)  # optimizer state exists, and differs
            load_parts(path, [model.sharded_state(), opt.sharded_state()])
            full = model.full_state_dict()
            for name, value in saved["main"].items():
                assert torch.equal(full[name], value), name
            optim = full_optimizer_state(model, opt)
            for key, value in saved["optim"].items():
                assert torch.equal(optim[key], value), key
        return case

    run_world(4, load(4))  # 4 replicas of one shard
    run_world(2, load(0))  # plain FSDP over 2 ranks


# ------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (lambda: {"mesh": "2x2"}, TypeError, "mesh must be a torch.distributed.device_mesh"),
        (lambda: {"mesh": init_device_mesh("cpu", (4,))}, ValueError, "must be 2-D"),
        (lambda: {"mesh": _mesh(2), "group": dist.group.WORLD}, ValueError,
         "not both"),
        (lambda: {"mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard",
                                                                            "replicate"))},
         ValueError, "dimension 0 as the replicas"),
        (lambda: {"mesh": _mesh(2), "expert_modules": (Block,)}, ValueError,
         "expert_modules cannot be combined"),
    ],
    ids=["not-a-mesh", "1-d", "mesh-and-group", "names-reversed", "experts"],
)
def test_bad_meshes_are_refused_by_name(kwargs, exc, match):
    def case(ctx):
        with pytest.raises(exc, match=match):
            fully_shard(make_net(0), unit_modules=(Block,), **kwargs())

    run_world(4, case)


def test_hsdp_mesh_builds_the_named_mesh_or_refuses_the_count():
    results = {}

    def case(ctx):
        mesh = hsdp_mesh(2, "cpu")
        results[ctx.rank] = (tuple(mesh.shape), mesh.mesh_dim_names, hsdp_mesh(1, "cpu"))
        with pytest.raises(ValueError, match="replicas=3: the replica count must divide the "
                                             "world size 4"):
            hsdp_mesh(3, "cpu")

    run_world(4, case)
    assert set(results.values()) == {((2, 2), MESH_NAMES, None)}
