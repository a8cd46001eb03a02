"""Communicators over ``torch.distributed``: the ``torch`` comm plugin's implementation, and the base of comm plugins
that replace only some collectives (DeepEP's dispatch and combine)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from fw.interfaces.comm import Communicator


class TorchDistributed(Communicator):
    def __init__(self, ranks, rank, device, options=None, group=None):
        super().__init__(ranks, rank, device, options)
        if group is None and len(ranks) != dist.get_world_size():
            raise ValueError(f"ranks {ranks} are not the whole world: build subgroups with new_groups")
        self.group = group  # None: the whole world

    @classmethod
    def new_groups(cls, partition, rank, device, options=None):
        if len(partition) == 1:
            return super().new_groups(partition, rank, device, options)
        # Collective: every rank creates every group of the partition.
        group, _ = dist.new_subgroups_by_enumeration(partition)
        mine = next(ranks for ranks in partition if rank in ranks)
        return cls(mine, mine.index(rank), device, options, group)

    @classmethod
    def init_world(cls, rank, world_size, init_method, device, timeout_s):
        if dist.is_initialized():
            return
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )

    @classmethod
    def destroy_world(cls):
        if dist.is_initialized():
            dist.destroy_process_group()

    def _global(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def all_reduce(self, t):
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t, dim=-1):
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, t, dim=0):
        chunks = [c.contiguous() for c in t.chunk(self.world_size, dim=dim)]
        out = torch.empty_like(chunks[self.rank])
        dist.reduce_scatter(out, chunks, group=self.group)
        return out

    def all_to_all(self, t, send_counts, recv_counts):
        out = t.new_empty((sum(recv_counts), *t.shape[1:]))
        dist.all_to_all_single(
            out, t.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts, group=self.group
        )
        return out

    def broadcast(self, t, src=0):
        dist.broadcast(t, src=self._global(src), group=self.group)
        return t

    def send(self, t, dst):
        dist.send(t.contiguous(), dst=self._global(dst), group=self.group)

    def isend(self, t, dst):
        return dist.isend(t.contiguous(), dst=self._global(dst), group=self.group)

    def recv(self, t, src):
        dist.recv(t, src=self._global(src), group=self.group)
        return t

    def barrier(self):
        dist.barrier(group=self.group)
