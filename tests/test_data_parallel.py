"""Data parallelism behind `fw serve -dp N` (fw.data_parallel): replicas in their own processes, requests routed by
cached prefix and load, per-replica /metrics."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from conftest import fw_serve, together
from fw import LLM
from fw.data_parallel import BALANCE, DataParallelEngine, Replica, prompt_block_hashes
from fw.engine import EngineError
from fw.testing.models import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("Qwen2ForCausalLM", tmp_path_factory.mktemp("dp") / "qwen2")


def labelled(base: str, name: str) -> dict[str, float]:
    """One metric's samples by their ``engine`` label."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                out[sample.labels["engine"]] = sample.value
    return out


def test_two_replicas_share_the_requests_and_answer_as_one(model):
    """16 concurrent requests to -dp 2: both replicas take some (their /metrics say), and every answer is the one a
    single engine gives."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (int(n),), generator=gen).tolist() for n in torch.randint(8, 40, (16,), generator=gen)]
    bodies = [{"model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True} for p in prompts]

    def answers(base):
        with ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(lambda b: httpx.post(f"{base}/v1/completions", json=b, timeout=120), bodies))
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        return [r.json()["choices"][0]["text"] for r in replies]

    serve = ("--model", str(model), "--served-model-name", "tiny", "--num-kv-blocks", "64")
    with together(fw_serve(*serve), fw_serve(*serve, "-dp", "2")) as ((single, _), (base, _)):  # they start at once
        expected = answers(single)
        got = answers(base)
        routed = labelled(base, "fw:requests_routed_total")
        running = labelled(base, "fw:num_requests_running")
    assert got == expected
    assert set(routed) == {"0", "1"} and sum(routed.values()) == 16 and min(routed.values()) > 0, routed
    assert set(running) == {"0", "1"}


def _front(loads: list[int]) -> DataParallelEngine:
    """A front over stand-in replicas with these requests in flight (routing only: nothing runs)."""
    front = DataParallelEngine.__new__(DataParallelEngine)
    front.replicas = [Replica(rank, None, None) for rank in range(len(loads))]
    for replica, load in zip(front.replicas, loads, strict=True):
        replica.in_flight = load
    return front


def test_routing_prefers_the_replica_with_the_prompts_prefix_unless_it_is_far_busier():
    shared = list(range(3, 67))
    warm_prompt = {"prompt_token_ids": shared + [100, 101]}
    hashes = prompt_block_hashes(warm_prompt, 16)
    assert len(hashes) == 4  # full blocks only
    front = _front([0, 0, 0])
    assert front.pick(hashes).rank == 0  # nobody has it: the least loaded (the first of equals)
    front.replicas[2].remember(hashes)
    assert front.pick(hashes).rank == 2
    # A prompt sharing three of its blocks goes there too; one sharing none goes to the least loaded.
    assert front.pick(prompt_block_hashes({"prompt_token_ids": shared[:48] + list(range(200, 230))}, 16)).rank == 2
    assert front.pick(prompt_block_hashes({"prompt_token_ids": list(range(300, 380))}, 16)).rank == 0
    front.replicas[2].in_flight = BALANCE  # busier, but within the balance: the cache still wins
    assert front.pick(hashes).rank == 2
    front.replicas[2].in_flight = BALANCE + 1
    assert front.pick(hashes).rank == 0
    # The salt is part of the prefix: a salted prompt matches nothing unsalted.
    salted = prompt_block_hashes({**warm_prompt, "cache_salt": "tenant-a"}, 16)
    assert front.replicas[2].matched(salted) == 0


def test_a_dead_replica_is_not_routed_to():
    front = _front([3, 0])
    front.replicas[1].alive = False
    assert front.pick([]).rank == 0
    front.replicas[0].alive = False
    with pytest.raises(EngineError, match="no data-parallel replica is running"):
        front.pick([])


def test_an_engine_is_one_replica(model):
    with pytest.raises(EngineError, match="an engine is one replica; fw serve runs several"):
        LLM(str(model), data_parallel_size=2)


def test_data_parallel_with_a_kv_connector_is_refused_by_name(model):
    """(-dp with -tp: tests/test_plugins.py, with the other settings not implemented yet.)"""
    from conftest import run_fw

    result = run_fw("plugins", "check", "--model", str(model), "-dp", "2", "--kv-connector", "disk")
    assert result.returncode != 0
    assert "--data-parallel-size (-dp) 2 with --kv-connector disk: a connector per replica is not implemented yet" \
        in result.stderr
