"""The LMCache KV connector: the conformance suite on each LMCache backend, then engines sharing an LMCache server.

Every test but the last two needs lmcache 0.5.6, which gets a virtualenv of its own (it requires numpy<=2.2.6 and
brings CUDA Python packages): see plugins/kvconnector/lmcache/README.md.
"""

from __future__ import annotations

import gc
import importlib.util
import socket
import subprocess
import sys
import time
import zlib

import pytest

from conftest import free_port
from fw.testing.conformance import KVConnectorConformance

needs_lmcache = pytest.mark.skipif(
    importlib.util.find_spec("lmcache") is None,
    reason="lmcache is not installed: it needs a virtualenv of its own, see plugins/kvconnector/lmcache/README.md",
)
# LMCache's telemetry imports a deprecated OpenTelemetry handler.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:opentelemetry.*")


def start_server(port):
    """An LMCache server (its in-memory store) on 127.0.0.1:``port``, once it accepts connections."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "the LMCache server did not start"
            time.sleep(0.2)


def stop_server(proc):
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server():
    """The URL of an LMCache server shared by the module's tests; each keeps to its own namespace."""
    port = free_port()
    proc = start_server(port)
    yield f"lm://127.0.0.1:{port}"
    stop_server(proc)


def namespace(tmp_path):
    """A namespace of the test's own: it gets a store of its own in this process and its own keys on a server."""
    return f"{zlib.crc32(str(tmp_path).encode()):08x}"


class LMCacheConformance(KVConnectorConformance):
    plugin = "lmcache"

    def connector_options(self, role, tmp_path):
        return {**super().connector_options(role, tmp_path), "cpu_bytes": "16MiB", "namespace": namespace(tmp_path)}


@needs_lmcache
class TestLMCacheCPU(LMCacheConformance):
    options = {"backend": "cpu"}


@needs_lmcache
class TestLMCacheDisk(LMCacheConformance):
    def connector_options(self, role, tmp_path):
        return {**super().connector_options(role, tmp_path), "backend": "disk", "path": str(tmp_path)}


@needs_lmcache
class TestLMCacheServer(LMCacheConformance):
    @pytest.fixture(autouse=True)
    def _server(self, server):
        self.url = server

    def connector_options(self, role, tmp_path):
        return {**super().connector_options(role, tmp_path), "backend": self.url}


# 64 shared tokens, then each prompt's own; every length but the first ends in a partial block.
PROMPTS = [{"prompt_token_ids": list(range(3, 67)) + tail} for tail in ([90], [91, 92, 93, 94, 95], list(range(5, 40)))]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from fw.testing.models import make_tiny_model

    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("lmcache") / "llama")


@pytest.fixture(scope="module")
def greedy():
    from fw import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(model, greedy):
    from fw import LLM

    return [o.outputs[0].token_ids for o in LLM(model, num_kv_blocks=64).generate(PROMPTS, greedy, use_tqdm=False)]


def lmcache_llm(model, backend, role, ns, prefix_caching=True):
    from fw import LLM

    options = {"backend": backend, "role": role, "namespace": ns, "cpu_bytes": "16MiB", "timeout": 2}
    return LLM(
        model,
        num_kv_blocks=64,
        kv_connector="lmcache",
        plugin_options={"kv_connector": options},
        enable_prefix_caching=prefix_caching,
    )


def produce(model, backend, ns, prompts, greedy):
    """A producer computes ``prompts`` and is gone: its store is closed, what it saved is on the server only."""
    from fw_kvconnector_lmcache.connector import LMCacheStore

    producer = lmcache_llm(model, backend, "producer", ns)
    producer.generate(prompts, greedy, use_tqdm=False)
    saved = producer.llm_engine.stats().kv_connector.bytes_saved
    producer.shutdown()
    del producer
    gc.collect()
    assert not [name for name in LMCacheStore._open if ns in name], "the producer's LMCache client is still open"
    return saved


def assert_free(llm):
    assert llm.llm_engine.kv.num_free_blocks() == 64


@needs_lmcache
def test_a_fresh_engine_loads_a_prefix_through_the_server_and_computes_only_the_last_token(
    model, reference, greedy, server, tmp_path
):
    ns = namespace(tmp_path)
    # Each prompt: its full blocks and its last, partial one.
    assert produce(model, server, ns, PROMPTS, greedy) > 0
    consumer = lmcache_llm(model, server, "consumer", ns, prefix_caching=False)
    outputs = consumer.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert [o.num_cached_tokens for o in outputs] == [len(p["prompt_token_ids"]) - 1 for p in PROMPTS]
    stats = consumer.llm_engine.stats().kv_connector
    assert stats.hits == sum(len(p["prompt_token_ids"]) - 1 for p in PROMPTS) and stats.failed_loads == 0
    # Every token but the last: 64 tokens in 4 blocks, 68 in 5, 98 in 7.
    assert stats.bytes_loaded == 16 * consumer.llm_engine.executor.runner.bytes_per_block
    assert stats.bytes_saved == 0  # a consumer saves nothing
    assert_free(consumer)


@needs_lmcache
def test_a_salted_prompt_loads_only_what_its_own_salt_saved(model, reference, greedy, server, tmp_path):
    ns = namespace(tmp_path)
    salted = {**PROMPTS[0], "cache_salt": "tenant-a"}
    produce(model, server, ns, [salted], greedy)
    consumer = lmcache_llm(model, server, "consumer", ns, prefix_caching=False)
    for prompt, hits in (({**PROMPTS[0], "cache_salt": "tenant-b"}, 0), (PROMPTS[0], 0), (salted, 64)):
        before = consumer.llm_engine.stats().kv_connector.hits
        assert consumer.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids == reference[0]
        assert consumer.llm_engine.stats().kv_connector.hits - before == hits, prompt


@needs_lmcache
def test_an_unreachable_server_means_computing_the_prompt(model, reference, greedy, tmp_path):
    nobody = f"lm://127.0.0.1:{free_port()}"  # nothing listens there
    llm = lmcache_llm(model, nobody, "both", namespace(tmp_path), prefix_caching=False)
    outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    stats = llm.llm_engine.stats().kv_connector
    assert stats.hits == 0 and stats.failed_loads == 0 and [o.num_cached_tokens for o in outputs] == [0, 0, 0]
    assert_free(llm)


@needs_lmcache
def test_a_server_gone_between_lookup_and_load_means_recompute_and_no_leak(model, reference, greedy, tmp_path):
    port = free_port()
    proc = start_server(port)
    ns, url = namespace(tmp_path), f"lm://127.0.0.1:{port}"
    try:
        produce(model, url, ns, PROMPTS[:1], greedy)
        consumer = lmcache_llm(model, url, "consumer", ns, prefix_caching=False)
        worker = consumer.llm_engine.executor.runner.kv_connector
        start_load_kv = worker.start_load_kv

        def server_dies_first(meta):
            if meta.loads:
                stop_server(proc)
            start_load_kv(meta)

        worker.start_load_kv = server_dies_first
        outputs = consumer.generate(PROMPTS[:1], greedy, use_tqdm=False)
    finally:
        if proc.poll() is None:
            stop_server(proc)
    assert outputs[0].outputs[0].token_ids == reference[0] and outputs[0].num_cached_tokens == 0
    stats = consumer.llm_engine.stats().kv_connector
    assert stats.hits == len(PROMPTS[0]["prompt_token_ids"]) - 1 and stats.failed_loads == 1
    assert_free(consumer)
    # Later requests look up in vain: they compute, and nothing leaks either.
    assert consumer.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids == reference[0]
    assert consumer.llm_engine.stats().kv_connector.failed_loads == 1
    assert_free(consumer)


@needs_lmcache
@pytest.mark.slow  # four `fw serve` processes
def test_router_in_front_of_a_prefill_and_a_decode_instance_sharing_a_server(model, server):
    from test_kvconnector_p2p import check_router_in_front_of, connector_args

    common = {"backend": server, "namespace": "router", "cpu_bytes": "64MiB"}
    check_router_in_front_of(
        model,
        connector_args("lmcache", role="producer", **common),
        connector_args("lmcache", role="consumer", **common),
    )


def test_check_names_the_missing_module_without_lmcache():
    """Runs everywhere: `lmcache` is hidden from a `fw plugins check` that asks for the connector."""
    code = (
        "import runpy, sys; sys.modules['lmcache'] = None; "  # find_spec('lmcache') is None from here on
        "sys.argv = ['fw', 'plugins', 'check', '--kv-connector', 'lmcache', '--device', 'cpu']; "
        "runpy.run_module('fw_cli', run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "kv_connector plugin 'lmcache' needs the Python package(s) lmcache, which are not installed" in out


def test_spec_is_light_and_validates_options():
    from fw.plugins import get_spec

    code = "import sys; from fw.plugins import get_spec; get_spec('kv_connector', 'lmcache'); print(sorted({'torch', 'lmcache'} & set(sys.modules)))"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    )
    spec = get_spec("kv_connector", "lmcache")
    assert spec.parse_options(None).backend == "cpu"
    assert spec.parse_options({"backend": "lm://127.0.0.1:65432", "role": "consumer"}).role == "consumer"
    for bad in ("redis://127.0.0.1:6379", "lm://127.0.0.1", "lm://:80", "memory"):
        with pytest.raises(ValueError, match="backend") as error:
            spec.parse_options({"backend": bad})
        assert "lm://HOST:PORT" in str(error.value)
    with pytest.raises(ValueError, match="namespace"):
        spec.parse_options({"namespace": "a@b"})  # LMCache's keys are @-separated
    with pytest.raises(ValueError, match="not_an_option"):
        spec.parse_options({"not_an_option": 1})
