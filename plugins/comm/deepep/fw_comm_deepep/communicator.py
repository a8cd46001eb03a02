"""MoE token routing with DeepEP's kernels; the other collectives are fw-comm-torch's (NCCL).

Normal (high-throughput, NVLink) kernels: each token reaches every rank owning one of its experts once, with
its choices as local expert ids (-1 for another rank's) and its weights; the experts weigh their outputs, and
``combine`` sums them per token. That is the ``Communicator.dispatch`` contract as it is.

Low-latency (RDMA) kernels hand each local expert its rows packed ``[local experts, capacity, hidden]`` and
weigh the outputs themselves in ``combine``: this plugin flattens the valid rows into the contract's form (one
choice per row, weight 1) and packs the outputs back.

Which kernels a dispatch uses is the same on every rank (they are collective): ``mode``, or under ``auto`` the
low-latency ones when no rank dispatches more than ``max_low_latency_tokens`` tokens (decode), learnt with one
all-reduce of the largest token count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import deep_ep
import torch
import torch.distributed as dist

from fw.interfaces.comm import Dispatched
from fw.sdk.torch_distributed import TorchDistributed


@dataclass
class _LowLatencyHandle:
    handle: Any  # DeepEP's
    counts: list[int]  # rows received by each local expert
    packed_shape: torch.Size
    topk_ids: torch.Tensor  # this rank's tokens' choices and weights, which the combine kernel applies
    topk_weights: torch.Tensor


class DeepEPCommunicator(TorchDistributed):
    def __init__(self, ranks, rank, device, options=None, group=None):
        super().__init__(ranks, rank, device, options, group)
        self._normal: deep_ep.Buffer | None = None
        self._low_latency: deep_ep.Buffer | None = None

    @property
    def _process_group(self) -> dist.ProcessGroup:
        return self.group if self.group is not None else dist.group.WORLD

    def _normal_buffer(self, hidden: torch.Tensor) -> deep_ep.Buffer:
        if self._normal is None:  # sized as DeepEP's own examples size it, for the first step's hidden width
            hidden_bytes = hidden.shape[1] * max(hidden.element_size(), 2)
            n = self.world_size
            configs = (deep_ep.Buffer.get_dispatch_config(n), deep_ep.Buffer.get_combine_config(n))
            nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden_bytes, n) for c in configs)
            self._normal = deep_ep.Buffer(self._process_group, nvl_bytes, 0)
        return self._normal

    def _low_latency_buffer(self, hidden: torch.Tensor, num_experts: int) -> deep_ep.Buffer:
        if self._low_latency is None:
            rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
                self.options.max_low_latency_tokens, hidden.shape[1], self.world_size, num_experts
            )
            self._low_latency = deep_ep.Buffer(
                self._process_group, 0, rdma_bytes, low_latency_mode=True,
                num_qps_per_rank=num_experts // self.world_size,  # the low-latency kernels need one per local expert
            )
        return self._low_latency

    def _use_low_latency(self, num_tokens: int) -> bool:
        if self.options.mode != "auto":
            return self.options.mode == "low_latency"
        most = torch.tensor([num_tokens], device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        return int(most.item()) <= self.options.max_low_latency_tokens

    def dispatch(self, hidden, topk_ids, topk_weights, num_experts):
        topk_ids = topk_ids.to(torch.int64)
        if self._use_low_latency(hidden.shape[0]):
            return self._dispatch_low_latency(hidden, topk_ids, topk_weights, num_experts)
        buffer = self._normal_buffer(hidden)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_ids, num_experts)
        recv, recv_ids, recv_weights, _, handle, _ = buffer.dispatch(
            hidden, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_ids, topk_weights=topk_weights.float(),
        )
        return Dispatched(recv, recv_ids, recv_weights.masked_fill(recv_ids < 0, 0.0), handle)

    def _dispatch_low_latency(self, hidden, topk_ids, topk_weights, num_experts):
        buffer = self._low_latency_buffer(hidden, num_experts)
        packed, counts, handle, _, _ = buffer.low_latency_dispatch(
            hidden, topk_ids, self.options.max_low_latency_tokens, num_experts, use_fp8=False
        )
        counts = counts.tolist()
        rows = torch.cat([packed[e, :count] for e, count in enumerate(counts)])
        experts = torch.arange(len(counts), device=rows.device).repeat_interleave(torch.tensor(counts, device=rows.device))
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)  # the combine kernel weighs
        return Dispatched(
            rows, experts.unsqueeze(1), ones, _LowLatencyHandle(handle, counts, packed.shape, topk_ids, topk_weights)
        )

    def combine(self, expert_out, handle):
        if not isinstance(handle, _LowLatencyHandle):
            combined, _, _ = self._normal.combine(expert_out, handle)
            return combined
        packed = expert_out.new_zeros(handle.packed_shape)
        start = 0
        for e, count in enumerate(handle.counts):
            packed[e, :count] = expert_out[start : start + count]
            start += count
        combined, _, _ = self._low_latency.low_latency_combine(
            packed, handle.topk_ids, handle.topk_weights.float(), handle.handle
        )
        return combined
