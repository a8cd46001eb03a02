"""Data parallelism with expert parallelism (`fw serve -dp 2 --enable-expert-parallel`, fw.data_parallel): the two
replicas are one gloo world whose expert-parallel group spans both, each holding half of every MoE layer's experts,
so they step in lockstep: a replica without requests joins the other's forward passes with dummy steps."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_parallel import GREEDY_PROMPTS, greedy

from fw.config import FwConfig
from fw.data_parallel import DataParallelEngine
from fw.engine import EngineError
from fw.engine.client import ReplicaStats
from fw.sdk.sampling_params import SamplingParams
from fw.validate import check

pytest.importorskip("fw_comm_torch")


def dp2_ep(path) -> DataParallelEngine:
    return DataParallelEngine(
        FwConfig(
            model={"model": str(path), "dtype": "float32", "device": "cpu"},
            cache={"num_kv_blocks": 32},
            parallel={"data_parallel_size": 2, "enable_expert_parallel": True},
        )
    )


def reports(front: DataParallelEngine, n: int = 2) -> list[ReplicaStats]:
    """Each replica's stats from its n-th report after this call (the first may have been on its way already)."""
    deadline = time.monotonic() + 30
    for _ in range(n):
        old = [r.stats for r in front.replicas]
        while any(r.stats is s for r, s in zip(front.replicas, old, strict=True)):
            assert time.monotonic() < deadline, "a replica stopped reporting"
            time.sleep(0.05)
    return [r.stats for r in front.replicas]


async def generate(front: DataParallelEngine, index: int, first_token: asyncio.Event | None = None) -> list[int]:
    """GREEDY_PROMPTS[index] as greedy() runs it (24 tokens), as one call to the front."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    request = ({"prompt_token_ids": GREEDY_PROMPTS[index]}, params, str(index), 0)
    async for _, output in front.generate_many([request]):
        tokens = output.outputs[0].token_ids  # the last output is the finished one
        if first_token is not None:
            first_token.set()
    return tokens


async def staggered(front: DataParallelEngine) -> list[list[int]]:
    """The first prompt alone on replica 0 until its first token, then the second on replica 1 (the least loaded),
    which finishes after the first: each replica has a moment without requests while the other steps."""
    first_token = asyncio.Event()
    first = asyncio.create_task(generate(front, 0, first_token))
    await first_token.wait()
    second = asyncio.create_task(generate(front, 1))
    return [await first, await second]


@pytest.mark.slow
@pytest.mark.timeout(300)  # without lockstep, the busy replica's all-to-all waits for the idle one forever
@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen3MoeForCausalLM"])
def test_dp2_with_expert_parallel_matches_one_process(checkpoint, arch):
    """24 greedy fp32 tokens of each prompt equal one process's without expert parallelism, though each replica
    holds half of the experts and, for a while, has no requests of its own (it ran dummy steps then)."""
    path = checkpoint(arch)
    expected = greedy(path)
    front = dp2_ep(path)
    try:
        got = asyncio.run(staggered(front))
        stats = reports(front)
    finally:
        front.shutdown()
    assert got == expected
    assert [r.routed for r in front.replicas] == [1, 1]
    assert all(s.dummy_steps > 0 for s in stats), stats
    assert [r.process.exitcode for r in front.replicas] == [0, 0]  # they left together, none killed


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_idle_expert_parallel_server_does_not_step(checkpoint):
    """No lockstep rounds before the first request, nor once every request has finished."""
    front = dp2_ep(checkpoint("MixtralForCausalLM"))
    try:
        assert [s.rounds for s in reports(front)] == [0, 0]
        assert asyncio.run(generate(front, 0)) == greedy(checkpoint("MixtralForCausalLM"))[0]
        settled = [s.rounds for s in reports(front)]
        assert [s.rounds for s in reports(front, 3)] == settled  # idle through three reports of each replica
    finally:
        front.shutdown()
    assert min(settled) >= 24  # a prefill and 23 decodes, the idle replica joining each


@pytest.mark.parametrize(
    ("parallel", "experts", "problem"),
    [
        ({"data_parallel_size": 2}, 4, None),
        ({"data_parallel_size": 2}, 3, "3 experts do not split evenly over 2 ranks"),
        ({"data_parallel_size": 2, "tensor_parallel_size": 2}, 4, "with tensor or pipeline parallelism"),
    ],
)
def test_expert_parallel_spans_the_replicas(parallel, experts, problem):
    config = FwConfig(model={"device": "cpu"}, parallel={**parallel, "enable_expert_parallel": True})
    hf_config = {"architectures": ["MixtralForCausalLM"], "hidden_size": 64, "num_local_experts": experts}
    problems = check(config, hf_config=hf_config).problems
    assert [p for p in problems if problem in p] if problem else problems == [], problems


def test_a_single_engine_is_not_a_replica_of_an_expert_parallel_world(checkpoint):
    from fw import LLM

    with pytest.raises(EngineError, match="an engine is one replica; fw serve runs several"):
        LLM(str(checkpoint("MixtralForCausalLM")), device="cpu", data_parallel_size=2, enable_expert_parallel=True)
