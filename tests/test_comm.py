"""The comm interface's versions, and the DeepEP plugin: installed everywhere, refused here with every reason."""

from __future__ import annotations

import pytest

from fw.interfaces import comm


def test_check_lists_every_reason_deepep_cannot_run_here(fw_cli):
    pytest.importorskip("fw_comm_deepep")
    result = fw_cli("plugins", "check", "--comm", "deepep", "--device", "cpu", "--dtype", "float32")
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout + result.stderr
    for reason in (
        "needs device cuda, got cpu",
        "needs a CUDA GPU of compute capability >= 9.0",
        "needs at least 2 devices, got 1",
        "does not support dtype float32 (supports bfloat16)",
        "needs the Python package(s) deep_ep, which are not installed",
    ):
        assert f"comm plugin 'deepep' {reason}" in out, out
    assert "usable comm plugins here: torch" in out



def test_a_v1_plugin_gets_the_default_dispatch_and_combine():
    """v1's dispatch/combine had other signatures and were never called: a v1 plugin's own are not used."""
    from fw.sdk.torch_distributed import TorchDistributed

    class OldStyle(TorchDistributed):
        def dispatch(self, hidden, topk_ids, num_experts):  # v1's signature
            raise AssertionError("v1 dispatch called")

    adapted = comm.adapt(OldStyle, 1)
    assert adapted.dispatch is comm.Communicator.dispatch and adapted.combine is comm.Communicator.combine
    assert adapted.all_to_all is TorchDistributed.all_to_all and adapted.api_version == 1
    assert comm.adapt(OldStyle, comm.API_VERSION) is OldStyle
