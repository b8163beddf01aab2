"""HSDP: hybrid sharding over a 2-D device mesh (replicate x shard), as PyTorch FSDP2's
``fully_shard(mesh=2-D mesh)`` and Megatron-FSDP's outer data-parallel dimension do.

``fully_shard(module, mesh=mesh)`` with a 2-D ``torch.distributed.device_mesh.DeviceMesh`` of
shape ``(R, S)``: dimension 0 **replicates**, dimension 1 **shards** (FSDP2's order; named
``("replicate", "shard")`` if the mesh names its dimensions). Every FSDP strategy then runs
inside each shard group of ``S`` ranks exactly as it does on a plain group of ``S`` ranks: the
flat layout, the all-gathers, the reduce-scatters, the optimizer state (sharded within the shard
group only: the ``R`` replicas of a shard hold the same shard and update it identically) and the
distributed MXFP8 quantization (its amax all-reduce within the shard group: every replica writes
the bytes of a plain run at ``S`` ranks). What HSDP adds:

- **gradients**: after the shard group's reduction (a reduce-scatter under ZeRO-2/3, an
  all-reduce under ZeRO-1 and ``no_shard``), one all-reduce of the reduced gradient over the
  replicate group, in the policy's grad-comm dtype, before it is added into ``main_grad``
  (``GradReducer``, label ``<group>/grad/replicas``, phase ``GRAD_REDUCE``). Gradients are divided
  by the whole data-parallel size ``R * S`` before the shard group's reduction, so the result is
  the mean over all ranks (summed in another order than at ``R * S`` flat ranks: equal to fp32
  reduction order, not bit for bit);
- **initial values**: rank 0 of the shard group broadcasts, then rank 0 of the replicate group
  (``init_sync``): every rank starts from global rank 0's values; ``InitSync.VERIFY`` compares
  every rank with it and raises on every rank together;
- **checkpoints**: only replica 0 writes main weights and optimizer state (the other replicas'
  files are empty); a checkpoint is read at any mesh shape or plain world size (its pieces are
  keyed by offsets within each parameter).

Gradient clipping, telemetry and step digests reduce over the shard group only (each replica
holds the whole model, sharded, and identical gradients). Expert units are not supported with a
mesh (their expert-DP groups would need a replicate dimension of their own).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["MeshGroups", "hsdp_mesh", "mesh_groups"]

REPLICATE, SHARD = 0, 1  # the mesh dimensions (FSDP2's HSDP order)
NAMES = ("replicate", "shard")


class MeshGroups:
    """The process groups of a 2-D mesh for this rank: ``shard`` (FSDP's data-parallel group)
    and ``replicate`` (None without a mesh); ``shape`` (R, S)."""

    def __init__(self, shard: dist.ProcessGroup | None, replicate: dist.ProcessGroup | None,
                 shape: tuple[int, int]):
        self.shard, self.replicate, self.shape = shard, replicate, shape


def _is_mesh(mesh: Any) -> bool:
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(mesh, DeviceMesh)


def mesh_groups(mesh: Any, group: dist.ProcessGroup | None, experts: bool) -> MeshGroups:
    """``fully_shard``'s ``mesh`` / ``group`` arguments as process groups; refuses what HSDP
    cannot take, naming the fix."""
    if mesh is None:
        return MeshGroups(group, None, (1, dist.get_world_size(group)))
    if not _is_mesh(mesh):
        raise TypeError(f"fully_shard: mesh must be a torch.distributed.device_mesh.DeviceMesh "
                        f"(init_device_mesh(device, (replicas, shards))), got "
                        f"{type(mesh).__name__}")
    if group is not None:
        raise ValueError("fully_shard: pass either group= (plain FSDP over one process group) or "
                         "mesh= (HSDP over a 2-D mesh), not both")
    if mesh.ndim != 2:
        raise ValueError(
            f"fully_shard: mesh must be 2-D (replicate, shard) for HSDP, got a {mesh.ndim}-D mesh "
            f"of shape {tuple(mesh.shape)}; for plain FSDP over a 1-D mesh pass "
            f"group=mesh.get_group()")
    names = mesh.mesh_dim_names
    if names is not None and set(names) == set(NAMES) and tuple(names) != NAMES:
        raise ValueError(
            f"fully_shard: the mesh's dimensions are named {tuple(names)}; HSDP reads dimension 0 "
            f"as the replicas and 1 as the shards: build it as init_device_mesh(device, "
            f"(replicas, shards), mesh_dim_names=('replicate', 'shard'))")
    if experts:
        raise ValueError("fully_shard: expert_modules cannot be combined with an HSDP mesh "
                         "(expert groups have no replicate dimension here); use group= and "
                         "expert_group= instead")
    shape = (int(mesh.shape[REPLICATE]), int(mesh.shape[SHARD]))
    return MeshGroups(mesh.get_group(SHARD), mesh.get_group(REPLICATE), shape)


def hsdp_mesh(replicas: int, device: str) -> Any:
    """The ``(replicas, world / replicas)`` mesh named ``("replicate", "shard")`` over every rank
    (``device``: "cpu" or "cuda"), or None for ``replicas == 1`` (plain FSDP); what
    ``mxfp8-train --replicas`` passes to ``fully_shard(mesh=...)``. Refuses a count that does not
    divide the world size."""
    if replicas == 1:
        return None
    world = dist.get_world_size()
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1 or (
            world % replicas):
        raise ValueError(f"hsdp_mesh: replicas={replicas!r}: the replica count must divide the "
                         f"world size {world} (each replica is sharded over world / replicas "
                         f"ranks)")
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device, (replicas, world // replicas), mesh_dim_names=NAMES)
