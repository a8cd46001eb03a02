"""The disk KV connector: a producer's full prompt blocks come back, bit for bit, in a fresh consumer."""

import os
import pickle
import subprocess
import sys

import pytest
import torch

from fw.interfaces.base import Requirements
from fw.interfaces.kvconnector import PrefixBlockMeta
from fw.plugins import get_spec
from fw_kvconnector_disk.connector import KV_CONNECTOR

BLOCK_SIZE, NUM_BLOCKS, NUM_LAYERS = 16, 8, 2
PROMPT = list(range(1000, 1040))  # 40 tokens: two full blocks and a partial one


def connector(tmp_path, role):
    spec = get_spec("kv_connector", "disk")
    options = spec.parse_options({"path": str(tmp_path), "role": role})
    halves = spec.load()
    return halves.scheduler(options, BLOCK_SIZE), halves.worker(options)


def kv_caches(fill):
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, 2, 8)  # the default AttentionBackend.kv_cache_shape
    return [fill(shape) for _ in range(NUM_LAYERS)]


def run_step(worker, meta, caches):
    """What the model runner does with one step's metadata."""
    worker.start_load_kv(meta)
    for i, cache in enumerate(caches):
        worker.wait_for_layer_load(i)
        worker.save_kv_layer(i, cache, meta)
    worker.wait_for_save()


def produce(tmp_path, prompt, block_ids, caches):
    scheduler, worker = connector(tmp_path, "producer")
    worker.register_kv_caches(caches)
    assert scheduler.get_num_new_matched_tokens("p", prompt, 0) == 0  # a producer never loads
    scheduler.update_state_after_alloc("p", block_ids, 0)
    scheduler.request_computed("p", prompt, block_ids, len(prompt))
    meta = scheduler.build_connector_meta()
    run_step(worker, meta, caches)
    return meta


def test_round_trip_from_producer_to_a_fresh_consumer(tmp_path):
    gen = torch.Generator().manual_seed(0)
    produced = kv_caches(lambda shape: torch.randn(shape, generator=gen))
    meta = produce(tmp_path, PROMPT, [3, 5, 6], produced)
    assert [block_id for _, block_id, _ in meta.saves] == [3, 5]  # full blocks only
    produced_hashes = [h for _, _, h in meta.saves]
    assert sorted(os.listdir(tmp_path)) == sorted(f"{h:016x}.safetensors" for _, _, h in meta.saves)

    scheduler, worker = connector(tmp_path, "consumer")
    consumed = kv_caches(torch.zeros)
    worker.register_kv_caches(consumed)
    assert scheduler.get_num_new_matched_tokens("first-block", PROMPT[:16] + [7] * 24, 0) == 16
    assert scheduler.get_num_new_matched_tokens("unrelated", [7] * 40, 0) == 0
    # The prompt's last token is always computed locally, so a 32-token prompt loads one block only.
    assert scheduler.get_num_new_matched_tokens("short", PROMPT[:32], 0) == 16
    # Blocks already in the local prefix cache are not loaded again.
    assert scheduler.get_num_new_matched_tokens("cached", PROMPT, 16) == 16
    assert scheduler.get_num_new_matched_tokens("c", PROMPT, 0) == 32
    scheduler.update_state_after_alloc("c", [1, 7, 2], 32)
    scheduler.request_computed("c", PROMPT, [1, 7, 2], 40)  # a consumer never saves
    meta = scheduler.build_connector_meta()
    assert meta.loads == (("c", ((1, produced_hashes[0]), (7, produced_hashes[1]))),) and meta.saves == ()
    assert scheduler.build_connector_meta() == PrefixBlockMeta()  # each step's lists are handed out once

    run_step(worker, meta, consumed)
    report = worker.get_finished()
    assert report.failed == set() and report.bytes_loaded == 2 * NUM_LAYERS * consumed[0][:, 0].nbytes
    for before, after in zip(produced, consumed, strict=True):
        assert torch.equal(after[:, 1], before[:, 3])
        assert torch.equal(after[:, 7], before[:, 5])
        untouched = [b for b in range(NUM_BLOCKS) if b not in (1, 7)]
        assert not after[:, untouched].any()


def test_metadata_is_plain_picklable_data(tmp_path):
    meta = produce(tmp_path, PROMPT, [3, 5, 6], kv_caches(torch.ones))
    assert pickle.loads(pickle.dumps(meta)) == meta


def test_both_role_skips_blocks_already_on_disk_and_saves_new_ones_once(tmp_path):
    produce(tmp_path, PROMPT, [3, 5, 6], kv_caches(torch.ones))
    scheduler, worker = connector(tmp_path, "both")
    caches = kv_caches(torch.zeros)
    worker.register_kv_caches(caches)
    longer = PROMPT[:32] + list(range(50))  # 82 tokens: blocks 0-1 on disk, blocks 2-4 new
    assert scheduler.get_num_new_matched_tokens("a", longer, 0) == 32
    scheduler.update_state_after_alloc("a", [0, 1, 2, 3, 4, 5], 32)
    # A chunked prefill: the first step reaches token 64, the second the end of the prompt.
    scheduler.request_computed("a", longer, [0, 1, 2, 3, 4, 5], 64)
    meta = scheduler.build_connector_meta()
    assert [b for b, _ in meta.loads[0][1]] == [0, 1] and [b for _, b, _ in meta.saves] == [2, 3]
    run_step(worker, meta, caches)
    scheduler.request_computed("a", longer, [0, 1, 2, 3, 4, 5], 82)
    meta = scheduler.build_connector_meta()
    assert [b for _, b, _ in meta.saves] == [4]
    run_step(worker, meta, caches)
    assert len(os.listdir(tmp_path)) == 5  # and no temporary files left behind
    # Two requests with one new prefix in the same step: it is written once.
    scheduler.request_computed("x", [9] * 16, [6], 16)
    scheduler.request_computed("y", [9] * 16, [7], 16)
    assert len(scheduler.build_connector_meta().saves) == 1


def test_finished_request_drops_its_pending_transfers(tmp_path):
    scheduler, _ = connector(tmp_path, "both")
    scheduler.get_num_new_matched_tokens("a", PROMPT, 0)
    scheduler.request_computed("a", PROMPT, [3, 5, 6], 40)
    assert scheduler.request_finished("a", [3, 5, 6]) is False
    assert scheduler.build_connector_meta() == PrefixBlockMeta()


def test_unreadable_files_fail_the_load_untouched_and_skip_the_requests_saves(tmp_path, caplog):
    meta = produce(tmp_path, PROMPT, [3, 5, 6], kv_caches(torch.ones))
    _, worker = connector(tmp_path, "both")
    caches = [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 4, 8) for _ in range(NUM_LAYERS)]  # another model's shape
    worker.register_kv_caches(caches)
    (tmp_path / "0000000000000bad.safetensors").write_bytes(b"truncated")
    step = PrefixBlockMeta(
        loads=(("other-model", ((0, meta.saves[0][2]),)), ("corrupt", ((1, 0xBAD),)), ("gone", ((2, 0xDEAD),))),
        saves=(("corrupt", 4, 0x5AFE), ("fine", 5, 0x600D)),
    )
    run_step(worker, step, caches)
    report = worker.get_finished()
    assert report.failed == {"other-model", "corrupt", "gone"} and report.bytes_loaded == 0
    assert "one directory per model" in caplog.text
    assert not any(cache.any() for cache in caches)
    # What a failed request computed on top of missing KV is not saved; the others' blocks are.
    assert not (tmp_path / f"{0x5AFE:016x}.safetensors").exists()
    assert (tmp_path / f"{0x600D:016x}.safetensors").exists()
    assert worker.get_finished().failed == set()  # each report is handed out once


def test_spec_is_light_and_validates_options():
    code = (
        "import sys; from fw.plugins import get_spec\n"
        "spec = get_spec('kv_connector', 'disk')\n"
        "print('torch' in sys.modules, 'safetensors' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]
    spec = get_spec("kv_connector", "disk")
    assert spec.load() is KV_CONNECTOR
    assert spec.parse_options(None).role == "both"
    with pytest.raises(ValueError):
        spec.parse_options({"role": "reader"})
    assert spec.capabilities.problems(Requirements(device="cpu")) == []
    assert spec.capabilities.problems(Requirements(device="cuda", kv_cache_dtype="fp8_e4m3"))
