"""The offload KV connector: a shared prefix the primary pool evicted comes back from RAM or disk, output unchanged."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from conftest import wait_until
from fw import LLM, SamplingParams
from fw.plugins import get_spec
from fw.sdk.block_hash import block_hash_chain
from fw.testing.models import make_tiny_model
from fw_kvconnector_offload.connector import KV_CONNECTOR, TieredStore, block_file

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BS = 16
# The tiny Llama's block: 2 layers x K and V x 16 tokens x 2 KV heads x 16 dims x 4 bytes (fp32).
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4
FILE_BYTES = BLOCK_BYTES + 20  # a block file: the block after a 20-byte header
MAX_LEN, POOL = 2048, 128  # the pool holds one sequence of max_model_len, no more
PREFIX = [(7 * i) % 500 + 3 for i in range(2000)]  # 125 full blocks shared by A and B
A, B = PREFIX + [11] * 8, PREFIX + [12] * 8
# The working set's other half: with its outputs it takes every block of the pool, evicting the whole prefix.
OTHER = [(11 * i) % 497 + 5 for i in range(MAX_LEN - GREEDY.max_tokens)]
PREFIX_BLOCKS = len(PREFIX) // BS


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(
        "LlamaForCausalLM", tmp_path_factory.mktemp("offload") / "llama", max_position_embeddings=MAX_LEN
    )


def run_in_turn(llm, prompts=(A, OTHER, B)):
    """One request after the other, as a stream of users would send them; each request's tokens and output.

    With the connector, the tiers' bounds are checked after each request.
    """
    outputs = []
    for prompt in prompts:
        outputs += llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
        if llm.llm_engine.scheduler.transfers.connector is not None:
            assert_bounded(llm.llm_engine.scheduler.transfers.connector.store)
    return [o.outputs[0].token_ids for o in outputs], outputs


@pytest.fixture(scope="module")
def reference(model):
    return run_in_turn(LLM(model, num_kv_blocks=POOL, max_model_len=MAX_LEN))[0]


def offload_llm(model, path, cpu_bytes, disk_bytes):
    return LLM(
        model,
        num_kv_blocks=POOL,
        max_model_len=MAX_LEN,
        kv_connector="offload",
        plugin_options={"kv_connector": {"path": str(path), "cpu_bytes": cpu_bytes, "disk_bytes": disk_bytes}},
    )


def connector(llm):
    """The engine's two halves: (scheduler, worker)."""
    engine = llm.llm_engine
    return engine.scheduler.transfers.connector, engine.executor.runner.kv_connector


def assert_bounded(store):
    assert store.ram_used == sum(t.nbytes for t in store.ram.values()) <= store.cpu_bytes
    assert store.disk_used == sum(store.disk.values()) <= store.disk_bytes
    store._io.submit(int).result()  # the I/O thread ran every file operation queued so far (deletions too)
    files = {f: os.path.getsize(os.path.join(store.path, f)) for f in os.listdir(store.path) if f.endswith(".fwkv")}
    assert sorted(files) == sorted(os.path.basename(block_file(store.path, h)) for h in store.disk)
    assert sum(files.values()) <= store.disk_bytes


def test_evicted_prefix_comes_back_from_the_ram_tier(model, reference, tmp_path):
    llm = offload_llm(model, tmp_path, cpu_bytes=300 * BLOCK_BYTES, disk_bytes=0)
    tokens, outputs = run_in_turn(llm)
    assert tokens == reference
    scheduler, worker = connector(llm)
    assert worker.block_bytes == BLOCK_BYTES
    stats = llm.llm_engine.stats().kv_connector
    # OTHER took the whole pool, so B found none of the prefix there: the connector offered all of it, from RAM.
    assert outputs[2].num_cached_tokens == len(PREFIX)
    assert stats.hits == len(PREFIX) and worker.loaded_blocks == {"cpu": PREFIX_BLOCKS, "disk": 0}
    assert stats.failed_loads == 0 and stats.bytes_loaded == PREFIX_BLOCKS * BLOCK_BYTES
    assert len(scheduler.store.ram) == PREFIX_BLOCKS + len(OTHER) // BS and not scheduler.store.disk
    assert llm.llm_engine.kv.num_free_blocks() == POOL


def test_evicted_prefix_comes_back_from_the_disk_tier(model, reference, tmp_path):
    # RAM for 16 blocks: OTHER's blocks push every prefix block to disk.
    llm = offload_llm(model, tmp_path, cpu_bytes=16 * BLOCK_BYTES, disk_bytes=300 * FILE_BYTES)
    tokens, outputs = run_in_turn(llm)
    assert tokens == reference
    scheduler, worker = connector(llm)
    assert outputs[2].num_cached_tokens == len(PREFIX)
    assert llm.llm_engine.stats().kv_connector.hits == len(PREFIX)
    assert worker.loaded_blocks == {"cpu": 0, "disk": PREFIX_BLOCKS}


def test_corrupt_and_truncated_files_are_misses(model, reference, tmp_path):
    llm = offload_llm(model, tmp_path, cpu_bytes=16 * BLOCK_BYTES, disk_bytes=300 * FILE_BYTES)
    run_in_turn(llm, [A, OTHER])
    scheduler, worker = connector(llm)
    hashes = block_hash_chain(PREFIX[: len(PREFIX) // BS * BS], BS)
    corrupt, truncated = (Path(block_file(str(tmp_path), hashes[i])) for i in (5, 90))
    data = bytearray(corrupt.read_bytes())
    data[100] ^= 0x01  # one bit of the payload
    corrupt.write_bytes(data)
    os.truncate(truncated, FILE_BYTES - 1)

    tokens, outputs = run_in_turn(llm, [B])
    assert tokens == reference[2:]
    stats = llm.llm_engine.stats().kv_connector
    assert stats.failed_loads == 1 and outputs[0].num_cached_tokens == 0 and not worker.loaded_blocks["disk"]
    # The damaged blocks left the disk tier; recomputing the prompt saved them again, in RAM.
    assert scheduler.store.where(hashes[5]) == scheduler.store.where(hashes[90]) == "cpu"
    assert llm.llm_engine.kv.num_free_blocks() == POOL


def store_of(tmp_path, cpu_blocks, disk_blocks):
    spec = get_spec("kv_connector", "offload")
    options = spec.parse_options(
        {"path": str(tmp_path), "cpu_bytes": cpu_blocks * BLOCK_BYTES, "disk_bytes": disk_blocks * FILE_BYTES}
    )
    store = TieredStore.open(options)
    store.bind(1, BLOCK_BYTES)
    return store


def block(i):
    return torch.full((BLOCK_BYTES,), i, dtype=torch.uint8)


def test_each_tier_evicts_its_least_recently_used_blocks_within_its_bytes(tmp_path):
    store = store_of(tmp_path, cpu_blocks=2, disk_blocks=3)
    for h in range(1, 7):
        store.put(h, block(h))
        assert_bounded(store)
    assert list(store.ram) == [5, 6] and list(store.disk) == [2, 3, 4]  # 1 was the disk's least recent
    assert store.where(2) == "disk" and store.where(5) == "cpu"  # both now their tier's most recent
    store.put(7, block(7))  # RAM spills 6, the disk deletes 3
    assert list(store.ram) == [5, 7] and list(store.disk) == [4, 2, 6]
    assert_bounded(store)
    for h in (4, 2, 6):
        assert torch.equal(store.read(h).result(), block(h))
    assert store.where(3) is None and not os.path.exists(block_file(store.path, 3))


def test_a_store_starts_empty_writes_through_without_ram_and_is_one_per_path(tmp_path):
    spec = get_spec("kv_connector", "offload")
    stale, other = tmp_path / f"{9:016x}.fwkv", tmp_path / "notes.txt"  # an earlier run's block, and not a block
    stale.write_bytes(b"x")
    other.write_text("kept")
    store = store_of(tmp_path, cpu_blocks=0, disk_blocks=2)
    assert not stale.exists() and other.read_text() == "kept"
    store.put(1, block(1))
    store.wait_writes(store.cpu_bytes)  # as the worker does after each step's saves
    assert not store.ram and list(store.disk) == [1] and os.path.getsize(block_file(store.path, 1)) == FILE_BYTES
    options = spec.parse_options({"path": str(tmp_path), "cpu_bytes": 0, "disk_bytes": 2 * FILE_BYTES})
    assert TieredStore.open(options) is store  # the scheduler and worker halves share it
    with pytest.raises(ValueError, match="in use in this process"):
        TieredStore.open(spec.parse_options({"path": str(tmp_path)}))
    with pytest.raises(RuntimeError, match="another process uses"):  # the directory's lock is taken
        TieredStore(str(tmp_path), 0, FILE_BYTES)
    with pytest.raises(Exception, match="no tier"):
        spec.parse_options({"cpu_bytes": 0, "disk_bytes": 0})


def saved_then_looked_up(tmp_path, **options):
    """Halves whose store holds a 40-token prompt's two full blocks, on disk; request "c" is to load them."""
    spec = get_spec("kv_connector", "offload")
    options = spec.parse_options({"path": str(tmp_path), "cpu_bytes": 0, "disk_bytes": 8 * FILE_BYTES, **options})
    scheduler, worker = KV_CONNECTOR.scheduler(options, BS), KV_CONNECTOR.worker(options)
    caches = [torch.randn(2, 8, BS, 2, 16) for _ in range(2)]
    worker.register_kv_caches(caches)
    prompt = list(range(100, 140))
    scheduler.get_num_new_matched_tokens("p", prompt, 0)
    scheduler.request_computed("p", prompt, [3, 5, 6], len(prompt))
    meta = scheduler.build_connector_meta()
    for i, cache in enumerate(caches):
        worker.save_kv_layer(i, cache, meta)
    worker.wait_for_save()
    assert worker.get_finished().bytes_saved == 2 * BLOCK_BYTES

    assert scheduler.get_num_new_matched_tokens("c", prompt, 0) == 2 * BS
    scheduler.update_state_after_alloc("c", [1, 2, 7], 2 * BS)
    return scheduler, worker, caches


def test_disk_reads_never_block_the_step(tmp_path):
    """A load from disk is reported by a later get_finished; the step that starts it does not wait for it."""
    scheduler, worker, caches = saved_then_looked_up(tmp_path)
    gate = threading.Event()
    worker.store._io.submit(gate.wait)  # the I/O thread is busy: the reads queue behind
    worker.start_load_kv(scheduler.build_connector_meta())
    assert not worker.get_finished().loaded
    gate.set()
    report = wait_until(lambda: (r := worker.get_finished()).loaded and r)
    assert report.loaded == {"c"} and report.bytes_loaded == 2 * BLOCK_BYTES
    assert worker.loaded_blocks == {"disk": 2, "cpu": 0}
    for cache in caches:
        assert torch.equal(cache[:, [1, 2]], cache[:, [3, 5]])


def test_a_load_that_outlasts_the_timeout_fails(tmp_path):
    scheduler, worker, caches = saved_then_looked_up(tmp_path, timeout=0.05)
    before = [cache.clone() for cache in caches]
    gate = threading.Event()
    worker.store._io.submit(gate.wait)
    worker.start_load_kv(scheduler.build_connector_meta())
    # The 0.05 s pass while the reads wait for the I/O thread.
    report = wait_until(lambda: (r := worker.get_finished()).failed and r)
    assert report.failed == {"c"} and not report.loaded
    gate.set()
    worker.store._io.submit(int).result()  # the abandoned reads have completed
    assert not worker.get_finished().loaded
    assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))  # the abandoned reads wrote nothing
    assert scheduler.store.where(block_hash_chain(list(range(100, 140)), BS)[0]) == "disk"  # slow, not bad
