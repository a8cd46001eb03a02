"""Communication interface (plugin kind ``fw.comm``).

A comm plugin implements the collectives of one process group. The core
builds the groups (tensor-, pipeline-, data- and expert-parallel) from the
world layout and calls the group's methods from model layers. MoE expert
parallelism uses ``dispatch`` / ``combine``; their default implementation is
built on ``all_to_all``, which a specialised backend (DeepEP) replaces. The
core's own control messages (step inputs) never use these groups: they travel
on a CPU gloo group of the same torch.distributed world.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from fw.interfaces.base import Capabilities

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel

# 2: dispatch carries the routing weights and returns a Dispatched, combine only sums; new_groups added. v1's
# dispatch/combine were never called: adapt() gives a v1 plugin the default ones, built on its all_to_all.
API_VERSION = 2

OPS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast"})


@dataclass(frozen=True)
class CommCapabilities(Capabilities):
    ops: frozenset[str] = OPS

    KNOWN: ClassVar[dict[str, frozenset[str]]] = {**Capabilities.KNOWN, "ops": OPS}


@dataclass
class Dispatched:
    """What ``dispatch`` delivered to this rank: each received token once, with its choices among this rank's
    experts (local ids, -1 for a choice of another rank's expert, whose weight is 0), and ``handle``, what
    ``combine`` needs to send the outputs back."""

    hidden: torch.Tensor  # [R, H]
    topk_ids: torch.Tensor  # [R, k], int64
    topk_weights: torch.Tensor  # [R, k], float32
    handle: Any


@dataclass
class DispatchHandle:
    """The default ``dispatch``'s routing, for ``combine``."""

    send_counts: list[int]
    recv_counts: list[int]
    source: torch.Tensor  # the token of each row sent, in send order
    num_tokens: int


class Pending(Protocol):
    """An operation in flight; ``wait()`` returns once it is complete."""

    def wait(self) -> Any: ...


class Done:
    """The handle of an operation that completed before it was returned."""

    def wait(self) -> None:
        pass


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
        """Join torch.distributed's world once per process, before any group is built; the core builds its CPU
        (gloo) control plane on that world."""

    @classmethod
    def new_groups(
        cls, partition: list[list[int]], rank: int, device: str, options: BaseModel | None = None
    ) -> Communicator:
        """This rank's group of ``partition`` (disjoint groups of global ranks covering the world). Every rank
        calls it with the same partitions in the same order: backends create groups collectively."""
        mine = next(group for group in partition if rank in group)
        return cls(mine, mine.index(rank), device, options)

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

    def isend(self, t: torch.Tensor, dst: int) -> Pending:
        """Start sending ``t``, which must stay unchanged until the returned handle's ``wait()``: pipeline stages
        send a micro-batch on while computing the next. This default sends before returning."""
        self.send(t, dst)
        return Done()

    @abstractmethod
    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into the preallocated ``t`` and return it."""

    @abstractmethod
    def barrier(self) -> None: ...

    def exchange_counts(self, send_counts: list[int]) -> list[int]:
        """How many rows each rank will send to this one."""
        import torch

        counts = torch.tensor(send_counts, dtype=torch.int64, device=self.device)
        return self.all_to_all(counts, [1] * self.world_size, [1] * self.world_size).tolist()

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
    ) -> Dispatched:
        """Send each token once to every rank owning one of its chosen experts, with its routing weights.

        ``topk_ids`` [T, k] are global expert ids; rank r owns the contiguous experts
        ``[r * E / world_size, (r + 1) * E / world_size)``. The experts weigh their outputs by the received
        weights (DeepEP's normal kernels' contract), so ``combine`` only sums. This default sends the counts,
        the routing and the rows by ``all_to_all`` (the outputs come back by one more); a specialised backend
        (DeepEP) replaces it.
        """
        import torch

        per_rank = num_experts // self.world_size
        owner = torch.div(topk_ids, per_rank, rounding_mode="floor")  # [T, k]
        ranks = torch.arange(self.world_size, device=topk_ids.device)
        # (rank, token) pairs in rank order: each token goes once to each rank owning any of its choices.
        dest, source = (owner.unsqueeze(0) == ranks.view(-1, 1, 1)).any(-1).nonzero(as_tuple=True)
        send_counts = torch.bincount(dest, minlength=self.world_size).tolist()
        recv_counts = self.exchange_counts(send_counts)
        mine = owner[source] == dest.unsqueeze(1)
        local_ids = torch.where(mine, topk_ids[source] - (dest * per_rank).unsqueeze(1), -1)
        weights = torch.where(mine, topk_weights[source].float(), 0.0)
        # One exchange for the routing: ids (exact in float32 below 2^24) beside the weights.
        routing = self.all_to_all(torch.cat([local_ids.float(), weights], dim=1), send_counts, recv_counts)
        k = topk_ids.shape[1]
        return Dispatched(
            self.all_to_all(hidden[source], send_counts, recv_counts),
            routing[:, :k].long(),
            routing[:, k:],
            DispatchHandle(send_counts, recv_counts, source, hidden.shape[0]),
        )

    def combine(self, expert_out: torch.Tensor, handle: Any) -> torch.Tensor:
        """The inverse of ``dispatch``: each token's output is the sum of the weighted outputs its rows came back
        with, [T, H]."""
        back = self.all_to_all(expert_out, handle.recv_counts, handle.send_counts)
        return back.new_zeros(handle.num_tokens, back.shape[1]).index_add_(0, handle.source, back)


def adapt(impl: type[Communicator], api_version: int) -> type[Communicator]:
    """``impl`` as a plugin of this API, for one written against ``api_version`` (this or the previous one)."""
    if api_version >= API_VERSION:
        return impl

    class V1(impl):  # type: ignore[valid-type, misc]
        dispatch = Communicator.dispatch
        combine = Communicator.combine

    V1.api_version = api_version
    V1.__name__ = V1.__qualname__ = impl.__name__
    return V1
