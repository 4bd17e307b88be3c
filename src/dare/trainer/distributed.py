"""Distributed execution on PyTorch's own engine: torchrun + FSDP2 (``fully_shard``), gloo on CPU, NCCL on GPU.

``dare train`` relaunches itself under ``python -m torch.distributed.run`` when ``distributed.nproc > 1`` (users
never call torchrun). Each rank runs the same loop on its share of the step's batch; FSDP2 shards every decoder
layer and the root, and reduce-scatters gradients (averaged over ranks: losses are scaled by the data-parallel size
to turn that into the sum the additive losses need). With ``distributed.sequence_parallel`` N, groups of N ranks
share their data and split each sequence (``dare.models.sequence_parallel``).
"""
from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist


log = logging.getLogger(__name__)


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: Optional[str] = None
    local_world_size: Optional[int] = None  # processes per node (torchrun's LOCAL_WORLD_SIZE); None: all of them
    sequence_parallel: int = 1  # processes that share each micro-batch (``use_sequence_parallel``)
    _groups: Any = field(default=None, repr=False, compare=False)  # (data-parallel group, SequenceGroup)

    def use_sequence_parallel(self, size: int) -> "DistEnv":
        """Split the processes into groups of ``size`` consecutive ranks that share data (Ulysses sequence
        parallelism); data parallelism is over the groups. Every rank must call it (it creates process groups)."""
        if size == self.sequence_parallel:
            return self
        per_node = self.local_world_size or self.world_size
        if size < 1 or self.world_size % size or per_node % size:
            raise ValueError(f"distributed.sequence_parallel={size} must divide the {per_node} processes per node "
                             f"(a group of {size} lives on one node; {self.world_size} processes in all)")
        self.sequence_parallel, self._groups = size, None
        if size > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from ..models.sequence_parallel import SequenceGroup
            mesh = init_device_mesh(self.device.type, (self.world_size // size, size), mesh_dim_names=("dp", "sp"))
            self._groups = (mesh.get_group("dp"), SequenceGroup(mesh.get_group("sp"), size, self.rank % size))
        return self

    @property
    def dp_rank(self) -> int:
        """Which share of the data this process reads (the ranks of a sequence-parallel group read the same)."""
        return self.rank // self.sequence_parallel

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sequence_parallel

    def sequence_group(self):
        """This rank's ``SequenceGroup`` (None without sequence parallelism)."""
        return self._groups[1] if self._groups is not None else None

    @property
    def nodes(self) -> int:
        per_node = self.local_world_size or self.world_size
        if self.world_size % per_node:
            raise ValueError(f"{self.world_size} processes do not split into nodes of {per_node}")
        return self.world_size // per_node

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, backend: str = "auto") -> "DistEnv":
        """Read torchrun's environment; initialise the process group when there is more than one process."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        cuda = torch.cuda.is_available()
        device = torch.device(f"cuda:{local}") if cuda else torch.device("cpu")
        chosen = None
        if world > 1:
            chosen = backend if backend != "auto" else ("nccl" if cuda else "gloo")
            if chosen == "nccl" and not cuda:
                raise ValueError("distributed.backend: nccl needs CUDA devices; use gloo (or auto) on CPU")
            if cuda:
                torch.cuda.set_device(device)
            if not dist.is_initialized():
                dist.init_process_group(chosen)
        return cls(rank, world, local, device, chosen, per_node)

    # --- collectives (no-ops in a single process) ------------------------------------------------------
    def all_reduce_sums(self, values: dict[str, float], every_rank: bool = False) -> dict[str, float]:
        """Sum a dict of floats over the data shares (keys must match on every rank): over the data-parallel ranks,
        once per sequence-parallel group, whose ranks hold the same values; ``every_rank``: over all processes."""
        if not self.distributed or not values:
            return dict(values)
        keys = sorted(values)
        dev = self.device if self.backend == "nccl" else torch.device("cpu")
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=dev)
        group = self._groups[0] if self._groups is not None and not every_rank else None
        if group is None or self.dp_size > 1:
            dist.all_reduce(t, group=group)
        return {k: float(v) for k, v in zip(keys, t.tolist())}

    def all_true(self, flag: bool) -> bool:
        if not self.distributed:
            return bool(flag)
        return self.all_reduce_sums({"ok": 0.0 if flag else 1.0}, every_rank=True)["ok"] == 0.0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self, sync: bool = False) -> None:
        """Tear the process group down; ``sync`` after a run that finished on every rank (``close_process_group``).
        Never sync on an error path: the peer may be elsewhere."""
        if self.distributed and dist.is_initialized():
            close_process_group(sync)


def close_process_group(sync: bool = True, timeout_s: float = 300.0) -> None:
    """Destroy the default process group. ``sync``: first make sure every rank is done talking. A barrier alone is
    not enough: a rank returns from it while a peer may still be receiving its last message, and destroying the
    gloo pairs then aborts the peer ("terminate called without an active exception", seen in CI). So after the
    barrier each rank checks in at the rendezvous store (not a gloo pair) and waits for every other rank's check-in:
    once all have, no collective is in flight."""
    if not dist.is_initialized():
        return
    if sync and dist.get_world_size() > 1:
        import datetime
        dist.barrier()
        store = dist.distributed_c10d._get_default_store()
        store.set(f"dare/closed/{dist.get_rank()}", "1")
        store.wait([f"dare/closed/{r}" for r in range(dist.get_world_size())], datetime.timedelta(seconds=timeout_s))
    dist.destroy_process_group()


def device_mesh(env: DistEnv, sharding: str = "full"):
    """FSDP2's mesh: 1-D over every process ("full"), or [nodes, processes per node] ("hybrid": replicate across
    nodes, shard within one)."""
    from torch.distributed.device_mesh import init_device_mesh
    if sharding == "full":
        return init_device_mesh(env.device.type, (env.world_size,))
    if sharding != "hybrid":
        raise ValueError(f"distributed.sharding must be full or hybrid, got {sharding!r}")
    nodes = env.nodes
    return init_device_mesh(env.device.type, (nodes, env.world_size // nodes), mesh_dim_names=("replicate", "shard"))


def shard_model(model: torch.nn.Module, env: DistEnv, mixed_precision: str = "none",
                sharding: str = "full") -> torch.nn.Module:
    """FSDP2: ``fully_shard`` every decoder layer (or the model's ``fsdp_units()``), then the root (embeddings, final
    norm, LM head), on ``device_mesh(env, sharding)`` (a 2-D mesh makes it HSDP).

    ``mixed_precision="bf16"``: parameters are all-gathered in bfloat16 for compute and gradients reduced in fp32,
    while the sharded parameters and the optimizer state stay fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mesh": device_mesh(env, sharding)}
    if mixed_precision == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # A model may group modules that share weights into one unit (DiffusionGemma: encoder and decoder layer i).
    units = model.fsdp_units() if hasattr(model, "fsdp_units") else list(model.model.layers)
    for unit in units:
        fully_shard(unit, **kw)
    fully_shard(model, **kw)
    # MoE experts that receive no token on one rank get no gradient there; reduce zeros for them so every rank
    # issues the same reduce-scatters (otherwise the collectives mismatch and the run hangs).
    model.set_reduce_scatter_unused_params(True)
    return model


def set_grad_sync(model: torch.nn.Module, enabled: bool) -> None:
    """Skip FSDP's gradient reduce-scatter on all but the last micro-batch (no-op without FSDP)."""
    fn = getattr(model, "set_requires_gradient_sync", None)
    if fn is not None:
        fn(enabled)


def torchrun_command(nproc: int, argv: list[str], nnodes: int = 1, rdzv_endpoint: str = "",
                     rdzv_id: str = "dare") -> list[str]:
    """The command that reruns ``dare <argv>`` under torchrun: on this machine alone, or as one of ``nnodes`` nodes
    that meet by c10d rendezvous at ``rdzv_endpoint`` (every node runs the same command)."""
    if nnodes == 1:
        where = ["--standalone"]
    else:
        where = [f"--nnodes={nnodes}", "--rdzv_backend=c10d", f"--rdzv_endpoint={rdzv_endpoint}", f"--rdzv_id={rdzv_id}"]
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc_per_node={nproc}", "-m", "dare.cli", *argv]
