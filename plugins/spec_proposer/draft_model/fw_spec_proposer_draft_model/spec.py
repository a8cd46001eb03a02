"""The draft-model proposer's declaration and options (vLLM's ``{"model": PATH, "num_speculative_tokens": k}``)."""

from __future__ import annotations

from pydantic import Field

from fw.interfaces import spec_proposer
from fw.interfaces.draft_runner import DraftingOptions
from fw.interfaces.spec import BUILTIN_PRIORITY, PluginSpec


class DraftModelOptions(DraftingOptions):
    model: str = Field(description="The draft model's directory: a smaller model of the target's tokenizer and vocabulary.")


SPEC = PluginSpec(
    name="draft_model",
    kind="spec_proposers",
    impl="fw_spec_proposer_draft_model.proposer:DraftModelProposer",
    capabilities=spec_proposer.SpecProposerCapabilities(),
    api_version=1,
    options=DraftModelOptions,
    priority=BUILTIN_PRIORITY,
    description="A smaller model of the same tokenizer drafts k tokens per request, with a KV cache of its own.",
)
