"""Process layout and the per-process parallel groups.

Ranks are laid out as Megatron does: tensor parallel innermost, then
pipeline, then data parallel, so ``rank = (dp * PP + pp) * TP + tp``. Model
layers ask ``get_tp_group()`` for their collectives; without a distributed
run that is a single-rank group whose collectives are identities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fw.interfaces.comm import Communicator


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1

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

    def tp_group(self, rank: int) -> list[int]:
        dp, pp, _ = self.coords(rank)
        return [self.rank_of(dp, pp, t) for t in range(self.tensor_parallel_size)]

    def pp_group(self, rank: int) -> list[int]:
        dp, _, tp = self.coords(rank)
        return [self.rank_of(dp, p, tp) for p in range(self.pipeline_parallel_size)]

    def dp_group(self, rank: int) -> list[int]:
        _, pp, tp = self.coords(rank)
        return [self.rank_of(d, pp, tp) for d in range(self.data_parallel_size)]


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


_TP: Communicator = SingleRank()


def get_tp_group() -> Communicator:
    return _TP


def set_tp_group(group: Communicator) -> None:
    global _TP
    _TP = group


def init_tensor_parallel(
    comm_cls: type[Communicator],
    rank: int,
    layout: ParallelLayout,
    init_method: str,
    device: str,
    options=None,
    timeout_s: float = 120.0,
) -> Communicator:
    """Join the world with the selected comm plugin and install this rank's TP group."""
    comm_cls.init_world(rank, layout.world_size, init_method, device, timeout_s)
    ranks = layout.tp_group(rank)
    group = comm_cls(ranks, ranks.index(rank), device, options)
    set_tp_group(group)
    return group
