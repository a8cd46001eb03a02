"""Vocabulary-parallel token embedding and LM head.

Each rank holds a contiguous slice of ``ceil(vocab / tp)`` rows (the last
rank's tail is zero padding). The embedding looks up the ids it owns and
all-reduces; the LM head computes its slice of the logits and all-gathers.
With tied embeddings the head shares the embedding's parameter. On the CPU
the head packs its weight for fw's kernels (``fw.sdk.dense``; a copy when
tied): the largest matrix of a small model, read in full every decode step.
A quant plugin may replace that product (``QuantMethod.get_logits_method``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from fw.distributed import get_tp_group
from fw.sdk import dense
from fw.sdk.weights import check_dtype, check_shape

if TYPE_CHECKING:
    from fw.interfaces.quant import QuantMethod


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, params_dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.num_embeddings = num_embeddings
        rows_per_rank = -(-num_embeddings // self.tp.world_size)
        self.vocab_start = min(self.tp.rank * rows_per_rank, num_embeddings)
        self.vocab_end = min(self.vocab_start + rows_per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.empty(rows_per_rank, embedding_dim, dtype=params_dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        check_shape((self.num_embeddings, param.shape[1]), loaded, "vocabulary embedding")
        check_dtype(param, loaded, "vocabulary embedding")
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded[self.vocab_start : self.vocab_end])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        foreign = (local < 0) | (local >= self.vocab_end - self.vocab_start)
        out = F.embedding(local.masked_fill(foreign, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(foreign.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    tied = False

    def __init__(self, num_embeddings: int, embedding_dim: int, *, params_dtype: torch.dtype,
                 quant: QuantMethod | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype=params_dtype)
        self.quant = quant
        self.quantized: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.argmax: Callable[[torch.Tensor], torch.Tensor] | None = None  # greedy's tokens (dense.pack_argmax)

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's table (``tie_word_embeddings``)."""
        self.weight = embedding.weight
        self.tied = True

    def process_weights_after_loading(self) -> None:
        self.quantized = self.quant.get_logits_method(self.weight) if self.quant is not None else None
        if self.quantized is not None:
            if not self.tied:  # the quant method holds what it computes with
                del self.weight
            return
        packed = dense.pack_logits(self.weight)
        if self.tp.world_size == 1:  # a shard's argmax is not the vocabulary's
            self.argmax = dense.pack_argmax(self.weight, packed, self.num_embeddings)
        if packed is self.weight:
            return
        if self.tied:  # the embedding lookup needs the plain table: the head keeps a packed copy
            self.register_buffer("packed_weight", packed, persistent=False)
        else:
            del self.weight
            self.register_buffer("weight", packed, persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits over the full vocabulary, on every rank, whatever the model's dtype."""
        if self.quantized is not None:
            logits = self.quantized(hidden)
        else:
            logits = dense.logits(hidden, getattr(self, "packed_weight", self.weight))
        if self.tp.world_size > 1:
            logits = self.tp.all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of ``forward(hidden)``, int64 [N], by the kernel chosen for it (``dense.argmax``);
        None where this head has no such choice (quantized, sharded, off the CPU)."""
        return None if self.argmax is None else self.argmax(hidden)
