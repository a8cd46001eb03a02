"""The n-gram proposer's declaration and options (vLLM's ``prompt_lookup_max`` / ``prompt_lookup_min``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fw.interfaces import spec_proposer
from fw.interfaces.spec import BUILTIN_PRIORITY, PluginSpec


class NgramOptions(BaseModel):
    """Unset, both lengths are 5; one set, the other takes its value (as vLLM's)."""

    model_config = ConfigDict(extra="forbid")

    prompt_lookup_max: int | None = Field(None, ge=1, description="Longest suffix n-gram looked up.")
    prompt_lookup_min: int | None = Field(None, ge=1, description="Shortest suffix n-gram looked up.")

    @model_validator(mode="after")
    def _lengths(self) -> NgramOptions:
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_max = self.prompt_lookup_min = 5
        self.prompt_lookup_max = self.prompt_lookup_max or self.prompt_lookup_min
        self.prompt_lookup_min = self.prompt_lookup_min or self.prompt_lookup_max
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min {self.prompt_lookup_min} is above prompt_lookup_max {self.prompt_lookup_max}"
            )
        return self


SPEC = PluginSpec(
    name="ngram",
    kind="spec_proposers",
    impl="fw_spec_proposer_ngram.proposer:NgramProposer",
    capabilities=spec_proposer.SpecProposerCapabilities(),
    api_version=1,
    options=NgramOptions,
    priority=BUILTIN_PRIORITY,
    description="Prompt lookup: drafts the tokens that followed the latest earlier occurrence of the context's last n-gram.",
)
