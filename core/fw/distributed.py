"""Process layout, the registry of parallel groups, and the control plane.

Ranks are laid out as Megatron does: tensor parallel innermost, then
pipeline, then data parallel, so ``rank = (dp * PP + pp) * TP + tp``. The
expert-parallel group, when enabled, spans DP x TP within a pipeline stage, as
vLLM's ``--enable-expert-parallel`` does. Model layers ask ``get_group(kind)``
(``get_tp_group()`` ...) for their collectives; without a distributed run every
group is a single-rank group whose collectives are identities.

The data plane (those groups) is the selected comm plugin's, NCCL on CUDA.
Step inputs and start-up agreements travel on the control plane instead: a
gloo group of the same world, because NCCL rejects the CPU tensors they are.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fw.interfaces.comm import Communicator

GROUP_KINDS = ("tp", "pp", "dp", "ep")


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp, pp, tp) coordinates of a global rank."""
        tp = rank % self.tensor_parallel_size
        pp = (rank // self.tensor_parallel_size) % self.pipeline_parallel_size
        dp = rank // (self.tensor_parallel_size * self.pipeline_parallel_size)
        return dp, pp, tp

    def rank_of(self, dp: int, pp: int, tp: int) -> int:
        return (dp * self.pipeline_parallel_size + pp) * self.tensor_parallel_size + tp

    def group(self, kind: str, rank: int) -> list[int]:
        """The global ranks of ``rank``'s group of ``kind`` (one of GROUP_KINDS)."""
        dp, pp, tp = self.coords(rank)
        tps, pps, dps = range(self.tensor_parallel_size), range(self.pipeline_parallel_size), range(self.data_parallel_size)
        if kind == "tp":
            return [self.rank_of(dp, pp, t) for t in tps]
        if kind == "pp":
            return [self.rank_of(dp, p, tp) for p in pps]
        if kind == "dp":
            return [self.rank_of(d, pp, tp) for d in dps]
        if kind == "ep":
            return [self.rank_of(d, pp, t) for d in dps for t in tps] if self.expert_parallel else [rank]
        raise ValueError(f"unknown group kind {kind!r} (known: {', '.join(GROUP_KINDS)})")

    def partition(self, kind: str) -> list[list[int]]:
        """Every group of ``kind``, each once, in order of their first rank."""
        groups: dict[int, list[int]] = {}
        for rank in range(self.world_size):
            ranks = self.group(kind, rank)
            groups.setdefault(ranks[0], ranks)
        return list(groups.values())


class SingleRank(Communicator):
    """The group of one process: every collective is the identity."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__([0], 0, device)

    @classmethod
    def init_world(cls, rank, world_size, init_method, device, timeout_s):  # pragma: no cover - nothing to join
        pass

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return t

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return t

    def all_to_all(self, t, send_counts, recv_counts):
        return t

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        return t

    def send(self, t, dst):
        raise RuntimeError("send on a single-rank group")

    def recv(self, t, src):
        raise RuntimeError("recv on a single-rank group")

    def barrier(self) -> None:
        pass


class ControlPlane:
    """Rank 0 to every rank on a CPU gloo group of the world, whatever backend the data plane uses."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")  # collective: every rank creates it

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def min(self, value: int) -> int:
        """The smallest of every rank's ``value``."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def max(self, values: list[int]) -> list[int]:
        """Each position's largest value over every rank's ``values``."""
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()


_SINGLE = SingleRank()
_GROUPS: dict[str, Communicator] = {}
_CONTROL: ControlPlane | None = None
_LAYER_PARTITION: list[int] | None = None  # decoder layers per pipeline stage; None: an even split


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, for a world's rendezvous (``tcp://HOST:PORT``)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def get_group(kind: str) -> Communicator:
    """This process's group of ``kind`` (one of GROUP_KINDS); a single-rank group outside a distributed run."""
    if kind not in GROUP_KINDS:
        raise ValueError(f"unknown group kind {kind!r} (known: {', '.join(GROUP_KINDS)})")
    return _GROUPS.get(kind, _SINGLE)


def get_tp_group() -> Communicator:
    return get_group("tp")


def get_pp_group() -> Communicator:
    return get_group("pp")


def get_ep_group() -> Communicator:
    """The expert-parallel group: single-rank unless ``--enable-expert-parallel`` (experts are then TP-sharded)."""
    return get_group("ep")


def stage_layers(num_layers: int) -> range:
    """The contiguous decoder layers of this rank's pipeline stage: as ``parallel.pp_layer_partition`` counts them
    where set (validation checked it against the model), else an even split, the first stages taking one more
    where it does not divide."""
    pp = get_pp_group()
    if _LAYER_PARTITION is None:
        per, extra = divmod(num_layers, pp.world_size)
        counts = [per + (stage < extra) for stage in range(pp.world_size)]
    else:
        counts = _LAYER_PARTITION
    start = sum(counts[: pp.rank])
    return range(start, start + counts[pp.rank])


def get_control_plane() -> ControlPlane | None:
    """The control plane of a distributed run; None in a single process."""
    return _CONTROL


def min_over_ranks(value: int) -> int:
    """The smallest ``value`` of all ranks (the value itself in a single process)."""
    return value if _CONTROL is None else _CONTROL.min(value)


def init_parallel(
    comm_cls: type[Communicator],
    rank: int,
    layout: ParallelLayout,
    init_method: str,
    device: str,
    options=None,
    timeout_s: float = 120.0,
    layer_partition: list[int] | None = None,
) -> None:
    """Join the world with the selected comm plugin, then build the control plane and this rank's groups;
    ``layer_partition`` (``parallel.pp_layer_partition``) is what ``stage_layers`` gives each stage."""
    global _CONTROL, _LAYER_PARTITION
    _LAYER_PARTITION = layer_partition
    comm_cls.init_world(rank, layout.world_size, init_method, device, timeout_s)
    if not dist.is_initialized():
        raise RuntimeError(f"comm plugin {comm_cls.__name__}.init_world did not join torch.distributed's world")
    _CONTROL = ControlPlane()
    for kind in GROUP_KINDS:  # the same order on every rank: groups are created collectively
        partition = layout.partition(kind)
        if len(partition[0]) > 1:
            _GROUPS[kind] = comm_cls.new_groups(partition, rank, device, options)


def destroy_parallel(comm_cls: type[Communicator]) -> None:
    """Leave the world; every group is single-rank again."""
    global _CONTROL, _LAYER_PARTITION
    _GROUPS.clear()
    _CONTROL = _LAYER_PARTITION = None
    comm_cls.destroy_world()
