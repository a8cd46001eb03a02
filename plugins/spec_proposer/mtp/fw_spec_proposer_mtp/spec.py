"""The MTP proposer's declaration and options (vLLM's ``{"method": "mtp", "num_speculative_tokens": k}``)."""

from __future__ import annotations

from pydantic import Field

from fw.interfaces import spec_proposer
from fw.interfaces.draft_runner import DraftingOptions
from fw.interfaces.spec import BUILTIN_PRIORITY, PluginSpec


class MTPOptions(DraftingOptions):
    model: str | None = Field(None, description="The checkpoint holding the MTP layers; the target's when unset.")


SPEC = PluginSpec(
    name="mtp",
    kind="spec_proposers",
    impl="fw_spec_proposer_mtp.proposer:MTPProposer",
    capabilities=spec_proposer.SpecProposerCapabilities(),
    api_version=1,
    options=MTPOptions,
    priority=BUILTIN_PRIORITY,
    description="DeepSeek-V3's multi-token-prediction layer drafts from the target's hidden states "
    "(num_speculative_tokens defaults to the checkpoint's num_nextn_predict_layers).",
)
