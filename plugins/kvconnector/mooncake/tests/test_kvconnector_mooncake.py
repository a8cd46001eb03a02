"""The Mooncake KV connector on loopback, in its two modes: transfer (p2p's side channel with the blocks moved by
Mooncake's Transfer Engine) and store (a Mooncake Store pool run by a mooncake_master that the tests start).

Every test but the checks of the plugin's spec needs the module `mooncake` (pip install
'fw-kvconnector-mooncake[mooncake]', after apt-get install libibverbs1)."""

from __future__ import annotations

import functools
import importlib.util
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import test_kvconnector_p2p as p2p_tests
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
from fw.testing.conformance import KVConnectorConformance

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


@needs_mooncake
def test_decode_engine_loads_through_mooncake_and_computes_only_the_last_prompt_token(model, reference):
    check_staged_loads(model, reference, producer_with, mooncake_llm)


@needs_mooncake
def test_a_failed_read_or_a_producer_gone_is_computed_and_nothing_leaks(model, reference):
    check_refused_read_and_producer_gone(model, reference, producer_with, mooncake_llm)


@needs_mooncake
def test_a_stage_past_the_timeout_is_computed_and_the_copy_is_dropped(model, reference, monkeypatch):
    from fw_kvconnector_mooncake.connector import MooncakeSideChannel

    producer, port, registrations = producer_with(model, PROMPTS[:1])
    answer, late = MooncakeSideChannel._answer, threading.Event()

    def late_stage(self, conn, header):
        if header.get("op") == "stage":
            late.wait(30)  # until the consumer is done
        answer(self, conn, header)

    monkeypatch.setattr(MooncakeSideChannel, "_answer", late_stage)
    consumer = mooncake_llm(model, role="consumer", peer=f"127.0.0.1:{port}", timeout=0.3, prefix_caching=False)
    # Done while the answer is held: computed, not waited for (a load that waited would find the KV and use it).
    outputs = consumer.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    late.set()
    assert_computed_and_freed(outputs, reference, consumer, producer)
    # The late copy is staged for a consumer that left, and dropped.
    assert settled(registrations, 1) == (1, 0)


@needs_mooncake
@pytest.mark.slow  # four `fw serve` processes: about 35 s here
def test_router_in_front_of_mooncake_prefill_and_decode_instances(model):
    port = free_port()
    check_router_in_front_of(
        model,
        connector_args("mooncake", role="producer", port=port),
        connector_args("mooncake", role="consumer", peer=f"127.0.0.1:{port}"),
    )


def test_check_names_the_missing_module_without_mooncake():
    """Runs everywhere: `mooncake` is hidden from a `fw plugins check` that asks for the connector."""
    code = (
        "import runpy, sys; sys.modules['mooncake'] = None; "  # find_spec('mooncake') is None from here on
        "sys.argv = ['fw', 'plugins', 'check', '--kv-connector', 'mooncake', '--device', 'cpu']; "
        "runpy.run_module('fw_cli', run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "kv_connector plugin 'mooncake' needs the Python package(s) mooncake, which are not installed" in out


def test_spec_is_light_and_has_its_own_options():
    from fw.plugins import get_spec

    code = "import sys; from fw.plugins import get_spec; get_spec('kv_connector', 'mooncake'); print(sorted({'torch', 'mooncake'} & set(sys.modules)))"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    )
    spec = get_spec("kv_connector", "mooncake")
    with pytest.raises(ValueError, match="needs peer"):  # p2p's checks
        spec.parse_options({"role": "consumer"})
    with pytest.raises(ValueError, match="transport"):  # not p2p's transports: Mooncake's
        spec.parse_options({"transport": "shm"})
    assert spec.parse_options({"protocol": "rdma", "device_name": "mlx5_0"}).protocol == "rdma"


# --- mode store -------------------------------------------------------------------------------------------------


@pytest.fixture
def master(tmp_path):
    """A mooncake_master on 127.0.0.1 (every port it opens), its address; stopped by SIGTERM at teardown."""
    rpc, metrics = free_port(), free_port()
    # mooncake.cli execs the binary that the wheel ships: the process started here is the master.
    args = [
        "--rpc_address=127.0.0.1",
        f"--rpc_port={rpc}",
        "--metrics_host=127.0.0.1",
        f"--metrics_port={metrics}",
    ]
    with open(tmp_path / "mooncake_master.log", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mooncake.cli", *args], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", rpc), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "mooncake_master.log").read_text()
            time.sleep(0.1)
    proc.address = f"127.0.0.1:{rpc}"
    yield proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)  # in case a test left it stopped
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def store_options(master, **options):
    return {"mode": "store", "master": master.address, "segment_mb": 32, **options}


@pytest.fixture
def store_llm(model, master):
    """Makes engines in store mode; shuts them down before the master goes (a Mooncake client that leaves a master
    gone retries for seconds)."""
    engines = []

    def make(prefix_caching=True, **options):
        engines.append(mooncake_llm(model, prefix_caching, **store_options(master, **options)))
        return engines[-1]

    yield make
    for llm in engines:
        llm.llm_engine.shutdown()


@needs_mooncake
class TestMooncakeStoreConformance(KVConnectorConformance):
    plugin = "mooncake"

    @pytest.fixture(autouse=True)
    def _master(self, master):
        self.master, self.workers = master, []
        yield
        for worker in self.workers:
            worker.shutdown()

    def connector_options(self, role, tmp_path):
        return {**super().connector_options(role, tmp_path), **store_options(self.master)}

    def _halves(self, role, tmp_path, caches):
        scheduler, worker = super()._halves(role, tmp_path, caches)
        self.workers.append(worker)
        return scheduler, worker


def saved_by_one_engine(store_llm, prompts=PROMPTS):
    """An engine (role both) that computed ``prompts`` and saved their blocks."""
    first = store_llm()
    first.generate(prompts, GREEDY, use_tqdm=False)
    stats = first.llm_engine.stats().kv_connector
    assert stats.hits == 0 and stats.bytes_saved > 0
    return first


def blocks(prompt_tokens):
    """Blocks of 16 that hold a prompt's tokens but the last (p2p's PROMPTS: the first 64 are shared)."""
    return -(-(prompt_tokens - 1) // 16)


@needs_mooncake
def test_a_fresh_engine_loads_what_another_saved_and_computes_only_the_last_prompt_token(reference, store_llm):
    first = saved_by_one_engine(store_llm)
    fresh = store_llm(prefix_caching=False)
    outputs = fresh.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert [o.num_cached_tokens for o in outputs] == [len(p["prompt_token_ids"]) - 1 for p in PROMPTS]
    stats = fresh.llm_engine.stats().kv_connector
    assert stats.hits == sum(len(p["prompt_token_ids"]) - 1 for p in PROMPTS) and stats.failed_loads == 0
    # The shared blocks were saved once, loaded by each prompt; what was loaded is in the store already, not put again.
    lengths = [len(p["prompt_token_ids"]) for p in PROMPTS]
    block_bytes = fresh.llm_engine.executor.runner.bytes_per_block
    saved = blocks(64 + 1) + sum(blocks(n) - blocks(64 + 1) for n in lengths)
    assert first.llm_engine.stats().kv_connector.bytes_saved == saved * block_bytes
    assert stats.bytes_loaded == sum(map(blocks, lengths)) * block_bytes and stats.bytes_saved == 0
    assert fresh.llm_engine.kv.num_free_blocks() == first.llm_engine.kv.num_free_blocks() == 64
    assert fresh.llm_engine.executor.runner.kv_connector._pulls == {}


@needs_mooncake
def test_a_salted_prompt_loads_only_what_its_own_salt_saved(reference, store_llm):
    salted = {**PROMPTS[0], "cache_salt": "tenant-a"}
    saved_by_one_engine(store_llm, [salted])
    fresh = store_llm(prefix_caching=False)
    loadable = len(salted["prompt_token_ids"]) - 1
    for prompt, hits in (({**salted, "cache_salt": "tenant-b"}, 0), (PROMPTS[0], 0), (salted, loadable)):
        before = fresh.llm_engine.stats().kv_connector.hits
        (output,) = fresh.generate([prompt], GREEDY, use_tqdm=False)
        assert output.outputs[0].token_ids == reference[0]
        assert fresh.llm_engine.stats().kv_connector.hits - before == hits, prompt.get("cache_salt")


def store_waits(caplog) -> int:
    """The store calls that waited out their timeout, as the connector logs them."""
    return sum("no answer in" in record.getMessage() for record in caplog.records)


@needs_mooncake
def test_a_master_gone_means_recompute_and_nothing_leaks(reference, master, store_llm, caplog):
    first = saved_by_one_engine(store_llm, PROMPTS[:1])
    fresh = store_llm(prefix_caching=False, timeout=2)
    # The master goes between the lookup, which found the blocks, and the load: the load fails, the prompt is computed.
    worker = fresh.llm_engine.executor.runner.kv_connector
    start_load_kv = worker.start_load_kv

    def master_dies_first(meta):
        if meta.loads:
            master.send_signal(signal.SIGTERM)
            master.wait(timeout=30)
        start_load_kv(meta)

    worker.start_load_kv = master_dies_first
    assert_computed_and_freed(fresh.generate(PROMPTS[:1], GREEDY, use_tqdm=False), reference, fresh, first)
    # Gone for good: lookups miss, saves are skipped, and the store is waited for at most once by each of the
    # engine's two clients (lookups, saves), not by each request's.
    hits = fresh.llm_engine.stats().kv_connector.hits
    caplog.clear()
    outputs = fresh.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert store_waits(caplog) <= 2, caplog.text
    assert [o.outputs[0].token_ids for o in outputs] == reference and [o.num_cached_tokens for o in outputs] == [0] * 3
    stats = fresh.llm_engine.stats().kv_connector
    assert stats.hits == hits and stats.failed_loads == 1 and worker._pulls == {}
    assert fresh.llm_engine.kv.num_free_blocks() == 64


@needs_mooncake
def test_a_master_that_stopped_answering_costs_one_wait_not_one_per_request(reference, master, store_llm, caplog):
    saved_by_one_engine(store_llm)
    fresh = store_llm(prefix_caching=False, timeout=0.5)
    caplog.clear()
    master.send_signal(signal.SIGSTOP)  # connections complete, nothing answers (Mooncake would wait 30 s a call)
    try:
        outputs = fresh.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        master.send_signal(signal.SIGCONT)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    # One wait for each of the engine's two store clients (lookups, saves): the first call's answer never comes,
    # and while it is awaited every later call is refused at once.
    assert store_waits(caplog) == 2, caplog.text
    # Nothing comes from a stopped master. A lookup was once seen answered all the same (1 CI run in 5, 64 hits:
    # Mooncake's client knew the blocks this process had saved); the load that followed failed, and the prompt
    # was computed.
    stats = fresh.llm_engine.stats().kv_connector
    assert stats.bytes_loaded == 0 and (stats.hits == 0 or stats.failed_loads > 0), stats


@needs_mooncake
def test_an_engine_without_its_master_says_so(model):
    port = free_port()  # nothing listens there
    # fw's own probe says so, before Mooncake's setup would retry for 90 s.
    with pytest.raises(RuntimeError, match=f"no mooncake_master answers at 127.0.0.1:{port}"):
        mooncake_llm(model, mode="store", master=f"127.0.0.1:{port}")


def test_store_options_are_checked():
    from fw.plugins import get_spec

    spec = get_spec("kv_connector", "mooncake")
    with pytest.raises(ValueError, match="mode store needs master=HOST:PORT"):
        spec.parse_options({"mode": "store", "role": "consumer"})  # and no peer needed
    with pytest.raises(ValueError, match="master"):
        spec.parse_options({"mode": "store", "master": "localhost"})
    with pytest.raises(ValueError, match="peer, port: not an option of mode store"):
        spec.parse_options({"mode": "store", "master": "h:1", "peer": "h:2", "port": 7000})
    with pytest.raises(ValueError, match="master: not an option of mode transfer"):
        spec.parse_options({"master": "h:1"})
    with pytest.raises(ValueError, match="segment_mb"):
        spec.parse_options({"mode": "store", "master": "h:1", "segment_mb": -1})
    options = spec.parse_options({"mode": "store", "master": "h:1", "role": "consumer", "segment_mb": "0"})
    assert (options.segment_mb, options.metadata_server, options.peer) == (0, "P2PHANDSHAKE", None)


@needs_mooncake
@pytest.mark.slow  # four `fw serve` processes
def test_router_in_front_of_store_mode_prefill_and_decode_instances(model, master):
    store = store_options(master)
    check_router_in_front_of(
        model,
        connector_args("mooncake", role="producer", **store),
        connector_args("mooncake", role="consumer", **store),
    )
