"""Communication interface (plugin kind ``fw.comm``).

A comm plugin implements the collectives of one process group. The core
builds the groups (tensor-, pipeline-, data- and expert-parallel) from the
world layout and calls the group's methods from model layers. MoE expert
parallelism uses ``dispatch`` / ``combine``; their default implementation is
two ``all_to_all`` calls, which a specialised backend (DeepEP) replaces.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from fw.interfaces.base import Capabilities

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel

API_VERSION = 1

OPS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast"})


@dataclass(frozen=True)
class CommCapabilities(Capabilities):
    ops: frozenset[str] = OPS

    KNOWN: ClassVar[dict[str, frozenset[str]]] = {**Capabilities.KNOWN, "ops": OPS}


@dataclass
class DispatchHandle:
    """What ``combine`` needs to route expert outputs back to their tokens."""

    send_counts: list[int]
    recv_counts: list[int]
    order: torch.Tensor  # permutation that grouped (token, k) pairs by destination rank
    num_tokens: int
    topk: int


class Communicator(ABC):
    """Collectives over one group of ranks. ``rank`` is the rank within the group."""

    api_version = API_VERSION

    def __init__(self, ranks: list[int], rank: int, device: str, options: BaseModel | None = None) -> None:
        self.ranks = ranks
        self.rank = rank
        self.world_size = len(ranks)
        self.device = device
        self.options = options

    @classmethod
    @abstractmethod
    def init_world(cls, rank: int, world_size: int, init_method: str, device: str, timeout_s: float) -> None:
        """Join the global world once per process, before any group is built."""

    @classmethod
    def destroy_world(cls) -> None:
        """Leave the world at shutdown."""

    @abstractmethod
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group; may work in place and returns the result."""

    @abstractmethod
    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``t`` along ``dim`` in rank order."""

    @abstractmethod
    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum over the group, then keep this rank's equal slice along ``dim``."""

    @abstractmethod
    def all_to_all(self, t: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Send rows ``t[sum(send_counts[:r]):...]`` to rank r; receive ``recv_counts[r]`` rows from each."""

    @abstractmethod
    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``t`` on every rank with ``src``'s (group rank) values."""

    @abstractmethod
    def send(self, t: torch.Tensor, dst: int) -> None: ...

    @abstractmethod
    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into the preallocated ``t`` and return it."""

    @abstractmethod
    def barrier(self) -> None: ...

    def exchange_counts(self, send_counts: list[int]) -> list[int]:
        """How many rows each rank will send to this one."""
        import torch

        out = self.all_to_all(torch.tensor(send_counts, dtype=torch.int64), [1] * self.world_size, [1] * self.world_size)
        return out.tolist()

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Send each (token, chosen expert) pair to the rank owning that expert.

        Experts are split into contiguous equal ranges per rank. Returns the
        received hidden rows, their global expert ids, and a handle for
        ``combine``.
        """
        import torch

        num_tokens, topk = topk_ids.shape
        per_rank = num_experts // self.world_size
        flat_experts = topk_ids.reshape(-1)
        dest = torch.div(flat_experts, per_rank, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=self.world_size).tolist()
        recv_counts = self.exchange_counts(send_counts)
        rows = hidden.repeat_interleave(topk, dim=0)[order]
        recv_hidden = self.all_to_all(rows, send_counts, recv_counts)
        recv_experts = self.all_to_all(flat_experts[order], send_counts, recv_counts)
        return recv_hidden, recv_experts, DispatchHandle(send_counts, recv_counts, order, num_tokens, topk)

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor) -> torch.Tensor:
        """Return expert outputs to their tokens and sum them with the router weights."""
        import torch

        back = self.all_to_all(expert_out, handle.recv_counts, handle.send_counts)
        rows = torch.empty_like(back)
        rows[handle.order] = back
        rows = rows.view(handle.num_tokens, handle.topk, -1)
        return (rows * topk_weights.unsqueeze(-1).to(rows.dtype)).sum(dim=1)
