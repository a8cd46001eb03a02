"""Sampler interface (plugin kind ``fw.sampler``).

Once per step the engine hands the sampler the logits of every request that
produces a token, as one float32 [B, V] tensor, plus a ``SamplingBatch``
describing each row. The sampler returns one token per row. Everything
per-request lives in ``SamplingBatch`` so a sampler can stay vectorised.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fw.interfaces.base import Capabilities

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel

    from fw.sampling_params import SamplingParams

API_VERSION = 1

# Feature flags: "seed", "logprobs", "penalties", "beam", "structured".


@dataclass(frozen=True)
class SamplerCapabilities(Capabilities):
    pass


@dataclass
class SamplingBatch:
    params: list[SamplingParams]  # one per logits row
    temperature: torch.Tensor  # [B] float32; 0 where the row is greedy
    all_greedy: bool
    generators: list[torch.Generator | None]  # per-row seeded generator, or None
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]  # tokens generated so far, for penalties


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32 log-probability of the chosen token


class Sampler(ABC):
    api_version = API_VERSION

    def __init__(self, options: BaseModel | None = None) -> None:
        self.options = options

    @abstractmethod
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput: ...
