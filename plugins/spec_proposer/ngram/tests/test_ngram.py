"""The n-gram proposer: what it looks up, its options, and the spec proposer conformance suite."""

from __future__ import annotations

import pytest

from fw.testing.conformance import SpecProposerConformance
from fw_spec_proposer_ngram.proposer import lookup
from fw_spec_proposer_ngram.spec import NgramOptions


class TestNgramProposer(SpecProposerConformance):
    plugin = "ngram"
    options = {"prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_the_longest_suffix_wins_and_its_latest_occurrence():
    # [1, 2, 3] occurs at 0 and at 5: the latest, at 5, is followed by 7, 8.
    assert lookup([1, 2, 3, 4, 9, 1, 2, 3, 7, 8, 1, 2, 3], 1, 3, 2) == [7, 8]
    # [5, 2, 3] occurs nowhere before; [2, 3] last at 6.
    assert lookup([1, 2, 3, 4, 9, 1, 2, 3, 7, 8, 5, 2, 3], 1, 3, 4) == [7, 8, 5, 2]
    # The 1-gram is looked up only when the 2-gram has no match, and not below prompt_lookup_min.
    assert lookup([4, 5, 6, 5], 1, 2, 2) == [6, 5]
    assert lookup([4, 5, 6, 5], 2, 2, 2) == []


def test_drafts_stop_at_the_end_of_the_context_and_at_k():
    assert lookup([7, 7, 7, 7], 2, 2, 3) == [7]  # [7, 7] last seen at 1: one token follows before the suffix
    assert lookup([1, 2, 1, 2, 1, 2], 2, 2, 1) == [1]
    assert lookup([5], 1, 3, 4) == []


def test_options_follow_vllm():
    assert NgramOptions().model_dump() == {"prompt_lookup_max": 5, "prompt_lookup_min": 5}
    assert NgramOptions(prompt_lookup_max=3).prompt_lookup_min == 3
    assert NgramOptions(prompt_lookup_min=2).prompt_lookup_max == 2
    with pytest.raises(ValueError, match="prompt_lookup_min 4 is above prompt_lookup_max 2"):
        NgramOptions(prompt_lookup_max=2, prompt_lookup_min=4)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        NgramOptions(prompt_lookup_max=0)
