"""The Mooncake KV connector: p2p's side channel with the blocks moved by Mooncake's Transfer Engine, on loopback.

Every test but the last needs the module `mooncake` (pip install 'fw-kvconnector-mooncake[mooncake]', after
apt-get install libibverbs1)."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
import time

import pytest
import test_kvconnector_p2p as p2p_tests
from test_kvconnector_p2p import (
    GREEDY,
    PROMPTS,
    P2PConformance,
    assert_computed_and_freed,
    check_router_in_front_of,
    connector_args,
    p2p_llm,
)

from conftest import free_port

model, reference = p2p_tests.model, p2p_tests.reference  # its module-scoped fixtures, here too

needs_mooncake = pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None,
    reason="mooncake is not installed: pip install 'fw-kvconnector-mooncake[mooncake]' (needs apt's libibverbs1)",
)

mooncake_llm = functools.partial(p2p_llm, connector="mooncake")


@needs_mooncake
class TestMooncakeConformance(P2PConformance):
    plugin = "mooncake"


class Registrations:
    """Stands in for a producer's Transfer Engine on its side channel: which staged buffers it holds registered.
    ``refuse``: register nothing (and say it did), so that consumers' reads fail in Mooncake."""

    def __init__(self, engine, refuse=False):
        self.engine, self.refuse = engine, refuse
        self.staged, self.held = 0, set()

    def register_memory(self, address, size):
        self.staged += 1
        self.held.add(address)
        return 0 if self.refuse else self.engine.register_memory(address, size)

    def unregister_memory(self, address):
        self.held.remove(address)
        return 0 if self.refuse else self.engine.unregister_memory(address)


def producer_with(model, prompts, **registrations):
    """A producer that computed ``prompts``, its Transfer Engine behind ``Registrations``."""
    port = free_port()
    producer = mooncake_llm(model, role="producer", port=port)
    producer.generate(prompts, GREEDY, use_tqdm=False)
    server = producer.llm_engine.executor.runner.kv_connector.server
    server.engine = Registrations(server.engine, **registrations)
    return producer, port, server.engine


def settled(registrations, staged, within=5.0):
    """Waits for ``staged`` copies to have been made and dropped (a copy goes when its consumer hangs up, a moment
    after the pull ended); returns how many were made and how many are still held."""
    deadline = time.monotonic() + within
    while (registrations.staged < staged or registrations.held) and time.monotonic() < deadline:
        time.sleep(0.05)
    return registrations.staged, len(registrations.held)


@needs_mooncake
def test_decode_engine_loads_through_mooncake_and_computes_only_the_last_prompt_token(model, reference):
    producer, port, registrations = producer_with(model, PROMPTS)
    consumer = mooncake_llm(model, role="consumer", peer=f"127.0.0.1:{port}", prefix_caching=False)
    outputs = consumer.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    # Every prompt token but the last came from the producer, one Transfer Engine read per prompt.
    assert [o.num_cached_tokens for o in outputs] == [len(p["prompt_token_ids"]) - 1 for p in PROMPTS]
    stats = consumer.llm_engine.scheduler.connector_stats
    assert stats.hits == sum(len(p["prompt_token_ids"]) - 1 for p in PROMPTS) and stats.failed_loads == 0
    assert settled(registrations, len(PROMPTS)) == (len(PROMPTS), 0)
    assert consumer.llm_engine.kv.num_free_blocks() == producer.llm_engine.kv.num_free_blocks() == 64


@needs_mooncake
def test_a_failed_read_or_a_producer_gone_is_computed_and_nothing_leaks(model, reference):
    producer, port, registrations = producer_with(model, PROMPTS[:1], refuse=True)
    consumer = mooncake_llm(model, role="consumer", peer=f"127.0.0.1:{port}", prefix_caching=False)
    # The lookup finds the blocks, the producer stages them, Mooncake's read is refused: the request computes.
    outputs = consumer.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert_computed_and_freed(outputs, reference, consumer, producer)
    assert settled(registrations, 1) == (1, 0)

    # Reads work again, but the producer is gone between the lookup and the pull.
    registrations.refuse = False
    worker = consumer.llm_engine.executor.runner.kv_connector
    start_load_kv = worker.start_load_kv

    def producer_dies_first(meta):
        if meta.loads:
            producer.llm_engine.shutdown()
        start_load_kv(meta)

    worker.start_load_kv = producer_dies_first
    assert_computed_and_freed(consumer.generate(PROMPTS[:1], GREEDY, use_tqdm=False), reference, consumer, producer, 2)


@needs_mooncake
def test_a_stage_past_the_timeout_is_computed_and_the_copy_is_dropped(model, reference, monkeypatch):
    from fw_kvconnector_mooncake.connector import MooncakeSideChannel

    producer, port, registrations = producer_with(model, PROMPTS[:1])
    answer = MooncakeSideChannel._answer

    def slow_stage(self, conn, header):
        if header.get("op") == "stage":
            time.sleep(2.0)
        answer(self, conn, header)

    monkeypatch.setattr(MooncakeSideChannel, "_answer", slow_stage)
    consumer = mooncake_llm(model, role="consumer", peer=f"127.0.0.1:{port}", timeout=0.3, prefix_caching=False)
    start = time.monotonic()
    outputs = consumer.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 1.8  # did not wait for the late answer
    assert_computed_and_freed(outputs, reference, consumer, producer)
    # The late copy is staged for a consumer that left, and dropped.
    assert settled(registrations, 1) == (1, 0)


@needs_mooncake
@pytest.mark.slow  # four `fw serve` processes: about 35 s here
def test_router_in_front_of_mooncake_prefill_and_decode_instances(model):
    port = free_port()
    check_router_in_front_of(model, connector_args("mooncake", role="producer", port=port),
                             connector_args("mooncake", role="consumer", peer=f"127.0.0.1:{port}"))


def test_check_names_the_missing_module_without_mooncake():
    """Runs everywhere: `mooncake` is hidden from a `fw plugins check` that asks for the connector."""
    code = ("import runpy, sys; sys.modules['mooncake'] = None; "  # find_spec('mooncake') is None from here on
            "sys.argv = ['fw', 'plugins', 'check', '--kv-connector', 'mooncake', '--device', 'cpu']; "
            "runpy.run_module('fw_cli', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "kv_connector plugin 'mooncake' needs the Python package(s) mooncake, which are not installed" in out


def test_spec_is_light_and_has_its_own_options():
    from fw.plugins import get_spec

    code = "import sys; from fw.plugins import get_spec; get_spec('kv_connector', 'mooncake'); print(sorted({'torch', 'mooncake'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    spec = get_spec("kv_connector", "mooncake")
    with pytest.raises(ValueError, match="needs peer"):  # p2p's checks
        spec.parse_options({"role": "consumer"})
    with pytest.raises(ValueError, match="transport"):  # not p2p's transports: Mooncake's
        spec.parse_options({"transport": "shm"})
    assert spec.parse_options({"protocol": "rdma", "device_name": "mlx5_0"}).protocol == "rdma"
