"""The engine drives a KV connector: prompt KV saved by one engine is loaded by a fresh one, output unchanged."""

from __future__ import annotations

import httpx
import pytest

from conftest import fw_serve, metric_values
from fw import LLM, SamplingParams
from fw.engine import EngineError
from fw.testing.models import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SHARED = list(range(3, 67))  # 64 tokens: four full blocks of 16
PROMPTS = [
    {"prompt_token_ids": SHARED + [90, 91, 92, 93, 94, 95]},  # 70 tokens: the four shared blocks can be loaded
    {"prompt_token_ids": SHARED[:16] + [7] * 30},  # only the first block is shared
    {"prompt_token_ids": [8] * 40},  # nothing shared
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("kvc") / "llama")


@pytest.fixture(scope="module")
def reference(model):
    return [o.outputs[0].token_ids for o in LLM(model, num_kv_blocks=64).generate(PROMPTS, GREEDY)]


def disk_llm(model, path, role, **kwargs):
    return LLM(model, num_kv_blocks=64, kv_connector="disk",
               plugin_options={"kv_connector": {"path": str(path), "role": role}}, **kwargs)


def run(llm, prompts=PROMPTS):
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], outputs


def test_disk_prefix_saved_by_one_engine_is_loaded_by_a_fresh_one(model, reference, tmp_path):
    producer = disk_llm(model, tmp_path, "producer")
    assert run(producer, PROMPTS[:1])[0] == reference[:1]
    stats = producer.llm_engine.stats().kv_connector
    assert stats.hits == 0 and stats.bytes_saved > 0
    assert len(list(tmp_path.glob("*.safetensors"))) == 4

    consumer = disk_llm(model, tmp_path, "consumer", enable_prefix_caching=False)
    tokens, outputs = run(consumer)
    assert tokens == reference
    stats = consumer.llm_engine.stats().kv_connector
    # Loaded: the four shared blocks of the first prompt, the first block of the second.
    assert stats.hits == 64 + 16 and stats.queries == 70 + 46 + 40 and stats.failed_loads == 0
    assert [o.num_cached_tokens for o in outputs] == [64, 16, 0]
    assert stats.bytes_loaded == 5 * producer.llm_engine.executor.runner.bytes_per_block
    assert consumer.llm_engine.kv.num_free_blocks() == 64


def test_a_salted_prompt_loads_only_what_its_own_salt_saved(model, reference, tmp_path):
    """cache_salt keeps tenants apart through a connector as in the prefix cache: another salt, or none, misses."""
    salted = [{**PROMPTS[0], "cache_salt": "tenant-a"}]
    run(disk_llm(model, tmp_path, "producer"), salted)
    for prompt, hits in (({**PROMPTS[0], "cache_salt": "tenant-b"}, 0), (PROMPTS[0], 0), (salted[0], 64)):
        consumer = disk_llm(model, tmp_path, "consumer", enable_prefix_caching=False)
        assert run(consumer, [prompt])[0] == reference[:1]
        assert consumer.llm_engine.stats().kv_connector.hits == hits, prompt


def test_a_failed_load_is_recomputed(model, reference, tmp_path):
    run(disk_llm(model, tmp_path, "producer"), PROMPTS[:1])
    files = sorted(tmp_path.glob("*.safetensors"))
    for f in files:
        f.write_bytes(f.read_bytes()[:100])  # truncated: unreadable

    consumer = disk_llm(model, tmp_path, "consumer", enable_prefix_caching=False)
    tokens, outputs = run(consumer)
    assert tokens == reference and [o.num_cached_tokens for o in outputs] == [0, 0, 0]
    stats = consumer.llm_engine.stats().kv_connector
    assert stats.failed_loads == 2 and stats.bytes_loaded == 0
    assert consumer.llm_engine.kv.num_free_blocks() == 64


# An asynchronous connector, in this process: blocks live in a dict, a load completes (or fails) a few steps
# after the step that scheduled it, and a finished request's saved blocks stay held for a few steps (a send).
MEMORY = '''
from pydantic import BaseModel
import torch
from fw.interfaces import kvconnector
from fw.interfaces.base import frozen
from fw.sdk.block_hash import block_hash_chain
from fw.interfaces.spec import PluginSpec

STORE = {}  # prefix hash -> {layer: block}
EVENTS = []


class Options(BaseModel, extra="forbid"):
    load_steps: int = 2
    send_steps: int = 0
    fail: bool = False


def hashes(token_ids, block_size, end, keys):
    return block_hash_chain(token_ids[: end // block_size * block_size], block_size, keys)


class Scheduler(kvconnector.KVConnectorScheduler):
    load_async = True

    def __init__(self, options, block_size):
        super().__init__(options, block_size)
        self.loads, self.saves, self.finished, self.matched, self.saved = [], [], [], {}, {}

    def get_num_new_matched_tokens(self, request_id, token_ids, num_computed_tokens, cache_keys=()):
        first = num_computed_tokens // self.block_size
        found = []
        for h in hashes(token_ids, self.block_size, len(token_ids) - 1, cache_keys)[first:]:
            if h not in STORE:
                break
            found.append(h)
        self.matched[request_id] = (first, found)
        return len(found) * self.block_size

    def update_state_after_alloc(self, request_id, block_ids, num_external_tokens):
        first, found = self.matched.pop(request_id, (0, []))
        for i, h in enumerate(found[: num_external_tokens // self.block_size]):
            self.loads.append((request_id, block_ids[first + i], h))

    def request_computed(self, request_id, token_ids, block_ids, num_computed_tokens, cache_keys=()):
        done = self.saved.setdefault(request_id, set())
        for i, h in enumerate(hashes(token_ids, self.block_size, num_computed_tokens, cache_keys)):
            if h not in STORE and i not in done:
                done.add(i)
                self.saves.append((block_ids[i], h))

    def build_connector_meta(self):
        meta = {"loads": self.loads, "saves": self.saves, "finished": self.finished}
        self.loads, self.saves, self.finished = [], [], []
        return meta

    def request_finished(self, request_id, block_ids):
        EVENTS.append(("finished", request_id, tuple(block_ids)))
        hold = bool(self.saved.pop(request_id, None)) and self.options.send_steps > 0
        if hold:
            self.finished.append(request_id)
        return hold


class Worker(kvconnector.KVConnectorWorker):
    def __init__(self, options):
        super().__init__(options)
        self.loading, self.sending = {}, {}

    def start_load_kv(self, meta):
        for request_id, block_id, h in meta["loads"]:
            self.loading.setdefault(request_id, [self.options.load_steps, []])[1].append((block_id, h))
        for request_id in meta["finished"]:
            self.sending[request_id] = self.options.send_steps

    def save_kv_layer(self, layer_idx, kv_cache, meta):
        for block_id, h in meta["saves"]:
            STORE.setdefault(h, {})[layer_idx] = kv_cache[:, block_id].clone()

    def get_finished(self):
        report = kvconnector.KVTransferReport()
        for request_id, entry in list(self.loading.items()):
            entry[0] -= 1
            if entry[0] <= 0:
                del self.loading[request_id]
                if self.options.fail:
                    report.failed.add(request_id)
                    continue
                for block_id, h in entry[1]:
                    for layer_idx, cache in enumerate(self.kv_caches):
                        cache[:, block_id].copy_(STORE[h][layer_idx])
                        report.bytes_loaded += STORE[h][layer_idx].nbytes
                report.loaded.add(request_id)
        for request_id in list(self.sending):
            self.sending[request_id] -= 1
            if self.sending[request_id] <= 0:
                del self.sending[request_id]
                report.sent.add(request_id)
        EVENTS.append(("report", report))
        return report


SPEC = PluginSpec(name="memory", kind="kv_connector", impl="fw_memory_kv:KV_CONNECTOR",
                  capabilities=kvconnector.KVConnectorCapabilities(devices=frozen("cpu")),
                  api_version=kvconnector.API_VERSION, description="test connector", options=Options)
KV_CONNECTOR = kvconnector.KVConnector(Scheduler, Worker)
'''


@pytest.fixture
def memory(fake_site, monkeypatch, request):
    """The asynchronous in-memory connector, installed in this process; yields its module."""
    import importlib
    import sys

    from fw import plugins

    site = fake_site("fw-memory-kv", {"fw.kv_connector": {"memory": "fw_memory_kv:SPEC"}}, {"fw_memory_kv": MEMORY})
    monkeypatch.syspath_prepend(str(site))
    plugins.refresh()
    request.addfinalizer(plugins.refresh)  # later tests must not see it
    sys.modules.pop("fw_memory_kv", None)  # a fresh store for each test
    return importlib.import_module("fw_memory_kv")


def memory_llm(model, **options):
    return LLM(model, num_kv_blocks=64, enable_prefix_caching=False, kv_connector="memory",
               plugin_options={"kv_connector": options})


def test_async_loads_wait_for_their_kv_then_run(model, reference, memory):
    producer = memory_llm(model)
    assert run(producer, PROMPTS[:1])[0] == reference[:1]
    assert len(memory.STORE) == 4
    memory.EVENTS.clear()

    consumer = memory_llm(model, load_steps=3)
    engine = consumer.llm_engine
    tokens, outputs = run(consumer)
    assert tokens == reference
    assert [o.num_cached_tokens for o in outputs] == [64, 16, 0]
    stats = engine.stats().kv_connector
    assert stats.hits == 80 and stats.failed_loads == 0
    assert stats.bytes_loaded == 5 * engine.executor.runner.bytes_per_block
    # Both loads were reported by the worker; the requests ran after, with the loaded tokens computed.
    assert set().union(*(e[1].loaded for e in memory.EVENTS if e[0] == "report")) == {"0", "1"}
    assert engine.kv.num_free_blocks() == 64 and not engine.scheduler.kv_pending


def test_failed_async_load_is_recomputed(model, reference, memory):
    run(memory_llm(model), PROMPTS[:1])
    consumer = memory_llm(model, fail=True)
    tokens, outputs = run(consumer)
    assert tokens == reference and [o.num_cached_tokens for o in outputs] == [0, 0, 0]
    engine = consumer.llm_engine
    assert engine.stats().kv_connector.failed_loads == 2
    assert engine.kv.num_free_blocks() == 64 and not engine.scheduler.kv_pending


def test_blocks_stay_held_until_their_send_completes(model, memory):
    llm = memory_llm(model, send_steps=3)
    engine = llm.llm_engine
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=1, n=2), request_id="a#b")
    engine.add_request(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=1), request_id="x#y")
    while len([e for e in memory.EVENTS if e[0] == "finished"]) < 3:
        engine.step()
    finished = {e[1]: e[2] for e in memory.EVENTS if e[0] == "finished"}
    assert sorted(finished) == ["a#b#0", "a#b#1", "x#y"] and engine.has_unfinished_requests()
    held = {block for blocks in finished.values() for block in blocks}  # a#b's sequences share their prompt's
    assert engine.kv.num_free_blocks() == 64 - len(held)
    # Blocks are held under these ids: neither a held id nor a held group's id can start again ...
    for request_id in ("a#b", "a#b#0", "x#y"):
        with pytest.raises(EngineError, match="already in use"):
            engine.add_request(PROMPTS[0], GREEDY, request_id=request_id)
    # ... but an id that only looks like one of theirs can.
    for request_id, n in (("x", 1), ("x", 2), ("a", 1)):
        engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=1, n=n), request_id=request_id)
        engine.abort_request(request_id)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert steps == 3 and engine.kv.num_free_blocks() == 64


def test_abort_during_an_async_load_holds_blocks_until_the_worker_is_done(model, memory):
    run(memory_llm(model), PROMPTS[:1])
    engine = memory_llm(model, load_steps=3).llm_engine
    engine.add_request(PROMPTS[0], GREEDY, request_id="r")
    engine.step()  # admitted: its load is in flight
    assert "r" in engine.scheduler.transfers.loading and engine.kv.num_free_blocks() == 64 - 4
    engine.abort_request("r")
    assert engine.kv.num_free_blocks() == 64 - 4  # the load may still write them
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.num_free_blocks() == 64


def test_fw_serve_loads_with_the_disk_connector_and_reports_it_in_metrics(model, reference, tmp_path):
    tokens, outputs = run(disk_llm(model, tmp_path, "producer"), PROMPTS[:1])
    assert tokens == reference[:1]
    with fw_serve("--model", str(model), "--served-model-name", "tiny", "--num-kv-blocks", "64",
                  "--kv-connector", "disk", "--plugin-option", f"kv_connector.path={tmp_path}",
                  "--plugin-option", "kv_connector.role=consumer") as (base, _):
        body = {"model": "tiny", "prompt": PROMPTS[0]["prompt_token_ids"], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        resp = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        metrics = metric_values(base)
    assert resp.json()["choices"][0]["text"] == outputs[0].outputs[0].text
    assert metrics["fw:external_prefix_cache_hits_total"] == 64
    assert metrics["fw:external_prefix_cache_queries_total"] == 70
    assert metrics["fw:kv_load_failures_total"] == 0 and metrics["fw:kv_transfer_seconds_total"] > 0


def test_a_connector_offering_too_much_fails_no_one(caplog):
    from fw.config import FwConfig
    from fw.interfaces.kvconnector import KVConnectorScheduler
    from fw.kv_cache import KVCacheManager
    from fw.request import Request
    from fw.scheduler import Scheduler

    class Greedy(KVConnectorScheduler):
        """Offers the whole prompt, its last token included."""

        def get_num_new_matched_tokens(self, request_id, token_ids, num_computed_tokens, cache_keys=()):
            return len(token_ids) - num_computed_tokens

        def update_state_after_alloc(self, request_id, block_ids, num_external_tokens):
            self.external = num_external_tokens

        def build_connector_meta(self):
            return None

    connector = Greedy(None, 4)
    sched = Scheduler(FwConfig(), KVCacheManager(16, 4), connector=connector)
    sched.add(Request("r", list(range(1, 11)), SamplingParams(max_tokens=4)))
    batch = sched.schedule()
    assert batch.num_new == [10] and connector.external == 0  # computed here instead
    assert "offered 10 tokens" in caplog.text and sched.transfers.stats.hits == 0
