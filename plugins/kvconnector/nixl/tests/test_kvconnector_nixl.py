"""The NIXL KV connector: p2p's side channel with the blocks read by NIXL (its UCX backend), on loopback.

Every test but the last two needs the module `nixl` (pip install 'fw-kvconnector-nixl[nixl]', then
pip install --no-deps nixl==1.5.1)."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import test_kvconnector_p2p as p2p_tests
import torch
from test_kvconnector_p2p import (
    GREEDY,
    PROMPTS,
    P2PConformance,
    assert_computed_and_freed,
    check_refused_read_and_producer_gone,
    check_router_in_front_of,
    check_staged_loads,
    connector_args,
    p2p_llm,
    settled,
)

from conftest import free_port

model, reference = p2p_tests.model, p2p_tests.reference  # its module-scoped fixtures, here too

needs_nixl = pytest.mark.skipif(
    importlib.util.find_spec("nixl") is None,
    reason="nixl is not installed: pip install 'fw-kvconnector-nixl[nixl]' && pip install --no-deps nixl==1.5.1",
)

nixl_llm = functools.partial(p2p_llm, connector="nixl")


@needs_nixl
class TestNixlConformance(P2PConformance):
    plugin = "nixl"


class Registrations:
    """Stands in for a NIXL agent (a producer's side channel's, or a consumer's worker's): counts the buffers it
    registers and holds. ``refuse``: register a decoy instead, so that consumers' reads find no registration.
    ``stall``: every read it posts stays in progress, as far as its poller can tell."""

    def __init__(self, agent, refuse=False, stall=False):
        self.agent, self.refuse, self.stall = agent, refuse, stall
        self.staged, self.held, self.decoys = 0, {}, []  # held: id -> registration

    def __getattr__(self, name):
        return getattr(self.agent, name)

    def register_memory(self, descs, mem_type):
        from fw_kvconnector_nixl.connector import regions

        self.staged += 1
        if self.refuse:
            self.decoys.append(np.zeros(64, dtype=np.uint8))
            descs = regions([self.decoys[-1].ctypes.data], 64)
        registered = self.agent.register_memory(descs, mem_type)
        self.held[id(registered)] = registered
        return registered

    def deregister_memory(self, registered):
        del self.held[id(registered)]
        self.agent.deregister_memory(registered)

    def transfer(self, read):
        state = self.agent.transfer(read)
        return "PROC" if self.stall else state

    def check_xfer_state(self, read):
        return "PROC" if self.stall else self.agent.check_xfer_state(read)


def producer_with(model, prompts, **registrations):
    """A producer that computed ``prompts``, its side channel's NIXL agent behind ``Registrations``."""
    port = free_port()
    producer = nixl_llm(model, role="producer", port=port)
    producer.generate(prompts, GREEDY, use_tqdm=False)
    server = producer.llm_engine.executor.runner.kv_connector.server
    server.agent = Registrations(server.agent, **registrations)
    return producer, port, server.agent


@needs_nixl
def test_decode_engine_loads_through_nixl_and_computes_only_the_last_prompt_token(model, reference):
    check_staged_loads(model, reference, producer_with, nixl_llm)


@needs_nixl
def test_a_failed_read_or_a_producer_gone_is_computed_and_nothing_leaks(model, reference):
    check_refused_read_and_producer_gone(model, reference, producer_with, nixl_llm)


@needs_nixl
def test_a_stage_past_the_timeout_is_computed_and_deregistered(model, reference, monkeypatch):
    from fw_kvconnector_nixl.connector import NixlSideChannel

    producer, port, registrations = producer_with(model, PROMPTS[:1])
    answer, late = NixlSideChannel._answer, threading.Event()

    def late_stage(self, conn, header):
        if header.get("op") == "stage":
            late.wait(30)  # until the consumer is done
        answer(self, conn, header)

    monkeypatch.setattr(NixlSideChannel, "_answer", late_stage)
    consumer = nixl_llm(model, role="consumer", peer=f"127.0.0.1:{port}", timeout=0.3, prefix_caching=False)
    # Done while the answer is held: computed, not waited for (a load that waited would find the KV and use it).
    outputs = consumer.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    late.set()
    assert_computed_and_freed(outputs, reference, consumer, producer)
    # The blocks are staged late, for a consumer that left, and deregistered.
    assert settled(registrations, 1) == (1, 0)


@needs_nixl
def test_a_read_past_the_timeout_is_cancelled_and_computed(model, reference):
    producer, port, staged = producer_with(model, PROMPTS[:1])
    consumer = nixl_llm(model, role="consumer", peer=f"127.0.0.1:{port}", timeout=1.0, prefix_caching=False)
    worker = consumer.llm_engine.executor.runner.kv_connector
    worker.agent = received = Registrations(worker.agent, stall=True)
    outputs = consumer.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert_computed_and_freed(outputs, reference, consumer, producer)
    # The consumer cancelled its read and deregistered its buffer; the producer deregistered the blocks.
    assert settled(received, 1) == (1, 0) and settled(staged, 1) == (1, 0)


@needs_nixl
@pytest.mark.slow  # four `fw serve` processes
def test_router_in_front_of_nixl_prefill_and_decode_instances(model):
    port = free_port()
    check_router_in_front_of(
        model,
        connector_args("nixl", role="producer", port=port),
        connector_args("nixl", role="consumer", peer=f"127.0.0.1:{port}"),
    )


@needs_nixl
@pytest.mark.skipif(torch.cuda.is_available(), reason="the plugin sets UCX_MODULES only without CUDA")
def test_a_process_that_ran_an_agent_exits_cleanly_and_an_idle_agent_takes_no_cpu():
    """UCX's InfiniBand module crashes a process at exit on a host without RDMA: the plugin keeps it out. NIXL's
    progress thread would poll UCX without pause, a whole core for as long as an instance runs: there is none."""
    code = (
        "import time; from fw_kvconnector_nixl.connector import start_agent; "
        "from fw_kvconnector_nixl.spec import NixlOptions; agent = start_agent(NixlOptions()); "
        "start = time.process_time(); time.sleep(1); print(time.process_time() - start)"
    )
    env = {name: value for name, value in os.environ.items() if name != "UCX_MODULES"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.split()[-1]) < 0.5  # CPU seconds in one idle second


@needs_nixl
def test_ucx_stays_on_loopback_when_every_peer_is_local(monkeypatch):
    from fw_kvconnector_nixl.connector import start_agent
    from fw_kvconnector_nixl.spec import NixlOptions

    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    start_agent(NixlOptions(role="consumer", peer="192.0.2.7:7000"))
    assert "UCX_NET_DEVICES" not in os.environ
    start_agent(NixlOptions(role="consumer", peer="localhost:7000"))
    assert os.environ["UCX_NET_DEVICES"] == "lo"


def test_check_names_the_missing_module_without_nixl():
    """Runs everywhere: `nixl` is hidden from a `fw plugins check` that asks for the connector."""
    code = (
        "import runpy, sys; sys.modules['nixl'] = None; "  # find_spec('nixl') is None from here on
        "sys.argv = ['fw', 'plugins', 'check', '--kv-connector', 'nixl', '--device', 'cpu']; "
        "runpy.run_module('fw_cli', run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "kv_connector plugin 'nixl' needs the Python package(s) nixl, which are not installed" in out


def test_spec_is_light_and_has_its_own_options():
    from fw.plugins import get_spec

    code = (
        "import sys; from fw.plugins import get_spec; get_spec('kv_connector', 'nixl'); "
        "print(sorted({'torch', 'nixl', 'nixl_cu12'} & set(sys.modules)))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
    spec = get_spec("kv_connector", "nixl")
    with pytest.raises(ValueError, match="needs peer"):  # p2p's checks
        spec.parse_options({"role": "consumer"})
    with pytest.raises(ValueError, match="transport"):  # not p2p's transports: NIXL's backends
        spec.parse_options({"transport": "shm"})
    assert spec.parse_options({"backend": "LIBFABRIC"}).backend == "LIBFABRIC"
