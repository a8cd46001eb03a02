"""Per-request sampling settings, with vLLM's names and ranges."""

from __future__ import annotations

from dataclasses import dataclass, field

# Below this a temperature means greedy; tiny positive values are clamped up to it so logits/T stays finite.
GREEDY_EPS = 1e-5


class SamplingParamsError(ValueError):
    """An out-of-range sampling value; the message names the field and the allowed range."""


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        checks = [
            ("n", self.n >= 1, ">= 1"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= -1, "-1, 0 (disabled) or a positive integer"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, ">= 1"),
            ("min_tokens", 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens), ">= 0 and <= max_tokens"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise SamplingParamsError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS
