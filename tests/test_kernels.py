"""Kernel choice by measurement (``fw.sdk.kernels``): the mechanism, and every candidate against its reference."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from conftest import wait_until
from fw import decode_graph
from fw.interfaces.attention import AttentionLayerSpec
from fw.sdk import dense, kernels, native, native_ops
from fw_attention_torch import backend as torch_attention
from fw_quant_fp8 import int8  # noqa: F401 (registers the int8 operations)
from fw_quant_fp8 import method as fp8_method
from fw_quant_fp8.numerics import E4M3, INT8, quantize_rows
from fw_quant_gguf import method as gguf_method
from fw_quant_gguf.dequant import row_bytes
from fw_quant_gguf.testing import random_blocks
from fw_quant_gptq import packed


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "kernels.json"
    monkeypatch.setenv("FW_KERNEL_CACHE", str(path))
    monkeypatch.delenv("FW_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "_others_share", lambda before, after: 0.0)  # a quiet machine
    return path


class _Fake:
    """An operation whose candidates take fixed, fake times per row count, and count how often they run."""

    def __init__(self, monkeypatch, times: dict[str, dict[int, float]], layouts: dict[str, str] | None = None,
                 untraceable: tuple[str, ...] = (), rows: tuple[int, ...] = (1, 32)):
        self.op = kernels.Operation(f"test.fake{id(self)}", reference="a", rows=rows)
        self.runs = dict.fromkeys(times, 0)
        self.prepared: list[str] = []
        layouts = layouts or {}
        for name in times:
            self.op.register(kernels.Candidate(
                name, run=lambda state, x, name=name: self._run(name, x), layout=layouts.get(name, "plain"),
                prepare=lambda w, name=name: self.prepared.append(name) or f"{w}:{layouts.get(name, 'plain')}",
                traceable=name not in untraceable))
        self.times, self.clock = times, [0.0]
        monkeypatch.setattr(kernels, "_clock", lambda: self.clock[0])

    def _run(self, name: str, x: torch.Tensor) -> str:
        self.runs[name] += 1
        self.clock[0] += self.times[name].get(x.shape[0], 0.0)  # calls after selection cost nothing
        return name

    def select(self, key=("k",)) -> kernels.Selection:
        return self.op.select(key, "w", lambda rows: (torch.zeros(rows, 4),))


def test_a_candidate_that_fails_here_is_never_chosen(cache, monkeypatch, caplog):
    fake = _Fake(monkeypatch, {"a": {1: 2.0, 32: 2.0}, "broken": {1: 1.0, 32: 1.0}})

    def broken(state, x):
        if x.shape[0] == 32:
            raise RuntimeError("needs sizes divisible by 16")
        return fake._run("broken", x)

    fake.op.candidates["broken"] = kernels.Candidate("broken", broken)
    assert fake.select().names == ("broken", "a")
    assert "kernel candidate broken failed here and is not chosen: needs sizes divisible by 16" in caplog.text


def test_the_fastest_candidate_per_row_class_runs_and_is_cached(cache, monkeypatch):
    fake = _Fake(monkeypatch, {"a": {1: 1.0, 32: 5.0}, "b": {1: 2.0, 32: 3.0}})
    selection = fake.select()
    assert selection.names == ("a", "b")
    assert selection(torch.zeros(1, 4)) == "a" and selection(torch.zeros(2, 4)) == "a"
    assert selection(torch.zeros(7, 4)) == "b" and selection(torch.zeros(2, 3, 4)) == "b"  # rows, not the batch dim
    stored = json.loads(cache.read_text())
    (entry,) = stored["machines"].values()
    assert entry["machine"]["cpu"] == kernels.machine()["cpu"]
    assert entry["choices"][fake.op.name] == {
        "('k',)": {"names": ["a", "b"], "among": ["a", "b"], "builds": native.builds()}}


def test_selection_is_deterministic_given_a_cache_file(cache, monkeypatch):
    fake = _Fake(monkeypatch, {"a": {1: 1.0, 32: 5.0}, "b": {1: 2.0, 32: 3.0}})
    fake.select()
    fake.times.update(a={1: 9.0, 32: 9.0}, b={1: 1.0, 32: 1.0})  # the machine now says the opposite
    fake.runs = dict.fromkeys(fake.runs, 0)
    kernels._CACHE._data = None  # as a new process would: read the file again
    assert fake.select().names == ("a", "b")
    assert fake.runs == {"a": 0, "b": 0}  # nothing timed
    assert fake.select(("other",)).names == ("b", "b")  # a new shape is measured


def test_another_machine_measures_again(cache, monkeypatch):
    fake = _Fake(monkeypatch, {"a": {1: 1.0, 32: 1.0}, "b": {1: 2.0, 32: 2.0}})
    fake.select()
    fake.times.update(a={1: 9.0, 32: 9.0})
    monkeypatch.setattr(kernels, "_cpu", lambda: ("Another CPU", "avx2 amx_bf16"))
    assert fake.select().names == ("b", "b")
    assert len(json.loads(cache.read_text())["machines"]) == 2


@pytest.mark.parametrize("content", ["{not json", '{"version": 2, "machines": []}', "[1, 2]", '{"version": 0}',
                                     '{"version": 2, "machines": {"x": 1}}', '{"version": 1, "machines": {}}'])
def test_a_corrupt_cache_file_is_ignored_and_rebuilt(cache, monkeypatch, content, caplog):
    cache.write_text(content)
    kernels._CACHE._data = None
    fake = _Fake(monkeypatch, {"a": {1: 1.0, 32: 1.0}, "b": {1: 2.0, 32: 2.0}})
    assert fake.select().names == ("a", "a")
    stored = json.loads(cache.read_text())
    assert stored["version"] == kernels.CACHE_VERSION
    assert any(fake.op.name in m["choices"] for m in stored["machines"].values() if isinstance(m, dict))


def test_a_choice_timed_on_a_busy_machine_serves_the_run_but_is_not_cached(cache, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="fw.sdk.kernels")
    fake = _Fake(monkeypatch, {"a": {1: 1.0, 32: 1.0}, "b": {1: 2.0, 32: 2.0}})
    monkeypatch.setattr(kernels, "_others_share", lambda before, after: 0.5)
    assert fake.select().names == ("a", "a")
    assert not cache.exists() and "other processes used 50%" in caplog.text
    fake.times.update(a={1: 9.0, 32: 9.0})
    assert fake.select().names == ("a", "a")  # this process keeps it: its layers of one shape agree


def test_the_choices_of_a_phase_are_one_info_line(cache, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="fw.sdk.kernels")
    fake = _Fake(monkeypatch, {"a": {1: 1.0, 32: 5.0}, "b": {1: 2.0, 32: 3.0}})
    with kernels.choosing("loading the model"):
        fake.select(("k",)), fake.select(("k",)), fake.select(("other",))  # two layers of one shape, and another
    info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert info == [f"fw: kernel choice (loading the model): 3 layers, 2 shapes chosen in {info[0].split(' in ')[1]}"]
    assert f"{fake.op.name} a/b x2 (rows 1/32)" in info[0]
    assert sum("chose a/b" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG) == 2
    caplog.clear()
    with kernels.choosing("a second start"):
        fake.select(("k",))
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]  # all from the cache: nothing to say


def test_a_choice_made_while_native_kernels_build_is_made_again_when_they_land(cache, monkeypatch, tmp_path, request):
    monkeypatch.setenv("FW_NATIVE", "1")
    monkeypatch.setenv("FW_NATIVE_BUILD", "background")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(kernels, "_PROVISIONAL", [])
    source = tmp_path / "empty.cpp"
    source.write_text("// a library without operators: builds in a moment\n")
    fake = _Fake(monkeypatch, {"slow": {1: 9.0, 32: 9.0}, "native": {1: 1.0, 32: 1.0}})
    fake.op.candidates["native"] = dataclasses.replace(
        fake.op.candidates["native"], supports=lambda key: native.load("fw_test_background", source))
    request.addfinalizer(functools.partial(torch.set_num_threads, torch.get_num_threads()))
    torch.set_num_threads(3)
    layers = [fake.select(), fake.select()]  # two layers of one shape
    assert [s.names for s in layers] == [("slow", "slow")] * 2 and native.building() == ["fw_test_background"]
    assert torch.get_num_threads() == 2 and native.threads() == 3  # the compiler has a core meanwhile
    assert not cache.exists()  # a choice made without a candidate that builds is not worth keeping
    wait_until(kernels.refresh, timeout=300)  # the engine asks between steps
    assert [s.names for s in layers] == [("native", "native")] * 2 and not native.building()
    assert torch.get_num_threads() == 3  # all back, before the kernels that landed were timed
    assert fake.runs["native"] == 2 * 2  # both layers' shape timed once: a warm-up and a call per row class
    assert not kernels.refresh()  # nothing more to land
    (entry,) = json.loads(cache.read_text())["machines"].values()
    assert entry["choices"][fake.op.name]["('k',)"]["names"] == ["native", "native"]


def test_other_processes_share_excludes_this_process(monkeypatch):
    monkeypatch.setattr(kernels.os, "sysconf", lambda name: 100)  # jiffies per second
    # 200 of 200 jiffies busy, 1 s (100 jiffies) of them this process's: others took half the machine
    assert kernels._others_share((100, 1000, 0.0), (300, 1200, 1.0)) == 0.5
    assert kernels._others_share((100, 1000, 0.0), (300, 1200, 2.0)) == 0.0  # all of it ours
    assert kernels._others_share(None, (300, 1200, 2.0)) == 0.0  # no /proc/stat: trusted
    assert kernels._cpu_times() is None or len(kernels._cpu_times()) == 3


def test_a_cached_name_no_longer_registered_is_measured_again(cache, monkeypatch):
    fake = _Fake(monkeypatch, {"a": {1: 1.0, 32: 1.0}, "b": {1: 2.0, 32: 2.0}})
    kernels._CACHE.store(fake.op.name, ("k",), ("gone", "gone"), {"gone": None})
    assert fake.select().names == ("a", "a")


def test_a_choice_made_among_fewer_candidates_is_measured_again_once_more_can_run(cache, monkeypatch):
    # As with FW_NATIVE=0 or a failed native build: only the slow candidate could run, and its choice was cached.
    fake = _Fake(monkeypatch, {"slow": {1: 9.0, 32: 9.0}, "native": {1: 1.0, 32: 1.0}})
    native = fake.op.candidates["native"]
    fake.op.candidates["native"] = dataclasses.replace(native, supports=lambda key: False)
    assert fake.select().names == ("slow", "slow")
    fake.op.candidates["native"] = native  # it builds now
    kernels._CACHE._data = None  # a new process
    assert fake.select().names == ("native", "native")
    kernels._CACHE._data = None
    fake.runs = dict.fromkeys(fake.runs, 0)
    assert fake.select().names == ("native", "native") and fake.runs == {"slow": 0, "native": 0}  # cached


def test_a_choice_timed_on_another_version_of_a_native_library_is_measured_again(cache, monkeypatch):
    fake = _Fake(monkeypatch, {"a": {1: 1.0, 32: 1.0}, "b": {1: 2.0, 32: 2.0}})
    monkeypatch.setattr(native, "_builds", {"fw_fake": "digest-1", "fw_other": "x"})
    assert fake.select().names == ("a", "a")
    fake.times.update(a={1: 9.0, 32: 9.0})  # the new version of the kernels makes "b" the faster
    kernels._CACHE._data = None
    monkeypatch.setattr(native, "_builds", {"fw_fake": "digest-1"})  # fw_other not loaded yet: no evidence
    assert fake.select().names == ("a", "a")
    kernels._CACHE._data = None
    monkeypatch.setattr(native, "_builds", {"fw_fake": "digest-2", "fw_new": "y"})
    assert fake.select().names == ("b", "b")
    kernels._CACHE._data = None
    fake.runs = dict.fromkeys(fake.runs, 0)
    assert fake.select().names == ("b", "b") and fake.runs == {"a": 0, "b": 0}  # the new choice is cached


def test_fw_kernels_forces_a_choice(cache, monkeypatch):
    fake = _Fake(monkeypatch, {"a": {1: 1.0, 32: 1.0}, "b": {1: 2.0, 32: 2.0}})
    monkeypatch.setenv("FW_KERNELS", "b")
    assert fake.select().names == ("b", "b")
    assert fake.runs == {"a": 0, "b": 0}
    monkeypatch.setenv("FW_KERNELS", f"other.op=a, {fake.op.name}=b")
    assert fake.select().names == ("b", "b")
    monkeypatch.setenv("FW_KERNELS", "c")  # no candidate of that name here: measured as usual
    assert fake.select().names == ("a", "a")
    monkeypatch.setenv("FW_KERNELS", f"{fake.op.name}=c")
    with pytest.raises(RuntimeError, match=rf"FW_KERNELS forces {fake.op.name}=c.*can: a, b"):
        fake.select()


def test_a_second_layout_is_kept_only_where_it_pays(cache, monkeypatch):
    # b's layout is 1.2x faster at 32 rows: not worth a second copy of the weight
    fake = _Fake(monkeypatch, {"a": {1: 1.0, 32: 1.2}, "b": {1: 2.0, 32: 1.0}}, layouts={"b": "packed"})
    selection = fake.select()
    assert selection.names == ("a", "a") and selection.states == ["w:plain"]
    # 2x faster: worth it
    fake = _Fake(monkeypatch, {"a": {1: 1.0, 32: 2.0}, "b": {1: 2.0, 32: 1.0}}, layouts={"b": "packed"})
    selection = fake.select(("k2",))
    assert selection.names == ("a", "b") and selection.states == ["w:plain", "w:packed"]


def test_a_candidate_a_captured_step_cannot_hold_must_be_far_faster_where_steps_are_captured(cache, monkeypatch):
    # b (oneDNN's prepacked weight, say) is 1.2x faster at 1 and 32 rows, where decode steps are captured: a captured
    # step beats it, so a runs there; at 256 rows (prompts) steps run eagerly and b's speed counts as any other's
    times = {"a": {1: 1.2, 32: 1.2, 256: 1.2}, "b": {1: 1.0, 32: 1.0, 256: 1.0}}
    fake = _Fake(monkeypatch, times, untraceable=("b",), rows=(1, 32, 256))
    assert kernels.CAPTURED_ROWS == decode_graph.MAX_BATCH and 32 <= kernels.CAPTURED_ROWS < 256
    assert fake.select().names == ("a", "a", "b")
    # 2x faster at 1 row: worth a step run eagerly there, not at 32 rows
    times = {"a": {1: 2.0, 32: 1.2, 256: 1.2}, "b": {1: 1.0, 32: 1.0, 256: 1.0}}
    fake = _Fake(monkeypatch, times, untraceable=("b",), rows=(1, 32, 256))
    assert fake.select(("k2",)).names == ("b", "a", "b")
    assert not dense.LINEAR.candidates["onednn"].traceable and dense.LINEAR.candidates["fw"].traceable


def test_a_far_slower_candidate_is_timed_once(cache, monkeypatch):
    fake = _Fake(monkeypatch, {"a": {1: 0.001, 32: 0.001}, "slow": {1: 0.01, 32: 0.01}})
    fake.select()
    assert fake.runs["slow"] == 2 * 2  # per row class: the warm-up and one timed call
    assert fake.runs["a"] > fake.runs["slow"]


def test_each_timed_call_finds_its_weights_evicted(cache, monkeypatch):
    """Kernel choice times a candidate on its prepared weight as a step meets it, in memory: the state's tensors
    (the tensor itself, or a tuple's or an object's) are evicted before every timed call, not before the warm-up."""
    order: list[str] = []
    weight = torch.ones(8, 4)

    class Packed:  # a plugin's prepared state: an object holding tensors
        def __init__(self, w):
            self.blocks, self.scales, self.shape = w.clone(), (w[:, 0].clone(),), w.shape

    clock = [0.0]  # each call takes a second: one timed round fills the measuring time
    monkeypatch.setattr(kernels, "_clock", lambda: clock[0])
    op = kernels.Operation("test.evicted", reference="plain", rows=(1, 32))
    for name, prepare in (("plain", lambda w: w), ("packed", Packed)):
        op.register(kernels.Candidate(name, run=lambda state, x, name=name: order.append(name) or clock.__setitem__(
            0, clock[0] + 1.0), prepare=prepare, layout=name))
    monkeypatch.setattr(kernels.native_ops, "evict", lambda tensors: order.append(
        "evict " + "+".join(str(tuple(t.shape)) for t in tensors)))
    op.select(("k",), weight, lambda rows: (torch.zeros(rows, 4),))
    # Per row class: the warm-ups, then a timed round
    assert order == ["plain", "packed", "evict (8, 4)", "plain", "evict (8, 4)+(8,)", "packed"] * 2


def test_evicting_keeps_the_values():
    """What kernel choice evicts is written back first: the weights read the same after."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(300, 257, generator=gen), torch.randn(64, 64, generator=gen).bfloat16()[:, 3:],
               torch.randint(-128, 127, (1000,), dtype=torch.int8, generator=gen), torch.empty(0)]
    copies = [t.clone() for t in tensors]
    native_ops.evict(tensors)
    assert all(torch.equal(t, c) for t, c in zip(tensors, copies, strict=True))
    if torch.backends.mkldnn.is_available():  # oneDNN's prepacked weight: an opaque tensor, found through oneDNN
        w = torch.randn(64, 32, generator=gen)
        packed, x = torch.ops.mkldnn._reorder_linear_weight(w, 1), torch.randn(3, 32, generator=gen)
        before = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        native_ops.evict([packed])
        assert torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), before)


# Every operation's example weights and inputs: a new operation must add its own here.
def _dense_examples(op):
    gen = torch.Generator().manual_seed(0)
    # Column blocks of 16 split between threads, each taking its own in threes: 6, 7 (4 + 3: two and two, three) and
    # 11 (6 + 5) blocks; 100 outputs fit no block.
    for out_features, in_features in ((96, 64), (112, 64), (176, 64), (100, 64), (64, 130)):
        w = (0.1 * torch.randn(out_features, in_features, generator=gen)).bfloat16()
        bias = torch.randn(out_features, generator=gen).bfloat16()
        yield w, (lambda rows, n=in_features: (torch.randn(rows, n, generator=gen).bfloat16(),)), (bias,)


def _argmax_examples(op):
    """LM heads (their padding rows no tokens), with the layouts pack_argmax reads: the logits by ``fw``, and by
    ``fw-amx``, at every row class where this CPU has them (the int8 candidates' tokens are those of the logits'
    kernel), else the plain weight widened."""
    gen = torch.Generator().manual_seed(0)
    for vocab, width, tokens in ((96, 64, 96), (160, 68, 150)):
        w = (0.1 * torch.randn(vocab, width, generator=gen)).bfloat16()
        usable = {c.name: c for c in dense.LOGITS.supported(dense._key(w))}
        kernels_here = [name for name in ("fw", "fw-amx") if name in usable]
        for name in kernels_here or [None]:
            packed, copy = w, [None] * 3  # without fw only 'logits' runs, which reads no int8 copy
            if name is not None:
                selection = dense.LOGITS._build(dense._key(w), w, (name,) * len(dense.LOGITS.rows), usable)
                packed, copy = selection.states[0], torch.ops.fw_dense.greedy_pack(w)
                packed.kernel = selection
            head = dense.ArgmaxHead(packed, dense._fw_tiles(w), copy, tokens)
            yield head, (lambda rows, n=width: (torch.randn(rows, n, generator=gen).bfloat16(),)), ()


def _gguf_examples(op):
    rng = np.random.default_rng(0)
    in_features = 256
    for types in ((GGMLQuantizationType.Q4_0,), (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1),
                  (GGMLQuantizationType.Q5_0,), (GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q4_K)):
        shards, offset, data = [], 0, []
        for qtype, rows in zip(types, (48, 16), strict=False):
            if qtype in (GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q4_K):  # gguf cannot write K-quants
                blocks = random_blocks(qtype, rows, in_features, rng, scale=1e-4).numpy()
            else:
                blocks = quants.quantize(rng.standard_normal((rows, in_features), dtype=np.float32), qtype)
            width = row_bytes(qtype, in_features)
            shards.append(gguf_method._Shard(qtype, offset, rows, width))
            data.append(torch.from_numpy(blocks.reshape(-1).copy()))
            offset += rows * width
        blocks = gguf_method._Blocks(torch.cat(data), shards, [v for s in shards for v in (s.offset, s.rows, int(s.qtype))])
        yield blocks, (lambda rows: (torch.randn(rows, in_features).bfloat16(),)), (None,)
    # float32 activations, a GGUF file's default: their own products (fw-dequant's oneDNN one)
    yield blocks, (lambda rows: (torch.randn(rows, in_features),)), (None,)


def _fp8_examples(op):
    gen = torch.Generator().manual_seed(0)
    for out_features, in_features, group in ((96, 64, None), (100, 200, 64)):
        weight, scale = quantize_rows(torch.randn(out_features, in_features, generator=gen))
        if group:  # block scales: one per row and group of input features
            scale = scale * torch.rand(out_features, -(-in_features // group), generator=gen)
        bias = torch.randn(out_features, generator=gen).bfloat16()
        yield (fp8_method.QuantizedRows(weight, scale, group),
               (lambda rows, n=in_features: (torch.randn(rows, n, generator=gen).bfloat16(),)), (bias,))


def _eight_bit_examples(op):
    gen = torch.Generator().manual_seed(0)
    element = E4M3 if op.name.startswith("fp8") else INT8
    for out_features, in_features in ((96, 64), (100, 200)):
        # Weights of a model's scale (std 1/sqrt(K)): outputs of order 1, whose bf16 rounding the tolerance covers
        weight, scale = quantize_rows(torch.randn(out_features, in_features, generator=gen) / in_features**0.5,
                                      element)
        bias = torch.randn(out_features, generator=gen).bfloat16()

        def sample(rows, n=in_features):
            return (torch.randn(rows, n, generator=gen).bfloat16(),)

        if op.name in ("int8.linear", "fp8.logits", "int8.logits"):
            yield fp8_method.QuantizedRows(weight, scale, None), sample, (bias,)
        else:  # dynamic and static activation scales
            yield fp8_method.W8A8Rows(weight, scale, None), sample, (bias,)
            yield fp8_method.W8A8Rows(weight, scale, None, torch.tensor(0.02)), sample, (bias,)


def _int_examples(op):
    gen = torch.Generator().manual_seed(0)
    # 4-bit in groups of 32, and of 128 with a last group of three blocks (two blocks a vector in fw-vnni512, one
    # without a partner) or of two (pairs of blocks in fw-dpbf16); 8-bit in groups of 64 with a partial last group
    # (and of 128, a shape AMX tiles take); irregular groups (torch only).
    for bits, out_features, in_features, g_idx in ((4, 96, 64, torch.arange(64) // 32),
                                                   (4, 40, 224, torch.arange(224) // 128),
                                                   (4, 36, 192, torch.arange(192) // 128),
                                                   (8, 100, 96, torch.arange(96) // 64),
                                                   (8, 48, 192, torch.arange(192) // 128),
                                                   (4, 48, 64, torch.randperm(64, generator=gen) % 3)):
        groups = int(g_idx.max()) + 1
        q = torch.randint(0, 1 << bits, (out_features, in_features), generator=gen, dtype=torch.uint8)
        zero = torch.randint(0, 1 << bits, (out_features, groups), generator=gen).float()
        scale = (0.01 * torch.rand(out_features, groups, generator=gen)).half()
        bias = torch.randn(out_features, generator=gen).bfloat16()
        yield (packed.repack(bits, q, zero, scale, g_idx),
               (lambda rows, n=in_features: (torch.randn(rows, n, generator=gen).bfloat16(),)), (bias,))


def _attention_examples(op):
    """Layers with GQA or not, a sliding window, a soft cap, each KV-cache dtype and several head sizes; decodes of
    requests with 1 to 90 tokens, prefill chunks over cached context. The weight is the layer's spec; the inputs come
    from real steps."""
    backend = torch_attention.TorchAttention()
    for heads, kv_heads, head_size, window, cap, dtype, kv_cache_dtype in (
        (14, 2, 64, None, None, torch.bfloat16, "auto"), (6, 3, 48, 5, None, torch.float32, "auto"),
        (4, 4, 32, None, 30.0, torch.bfloat16, "auto"), (6, 2, 64, 20, None, torch.bfloat16, "fp8"),
        (6, 2, 64, None, None, torch.float16, "int8"),
        # bf16 value rows summed in register passes of up to 7 heads (3 at head size 128), and a head size without one
        (16, 1, 64, 30, None, torch.bfloat16, "auto"), (12, 2, 128, None, None, torch.bfloat16, "auto"),
        (10, 2, 80, None, None, torch.bfloat16, "auto"),
    ):
        layer = AttentionLayerSpec(heads, kv_heads, head_size, head_size**-0.5, window, logits_soft_cap=cap,
                                   k_scale=0.5 if kv_cache_dtype == "fp8" else 1.0)
        spec = backend.kv_cache_spec(layer, 16, dtype, kv_cache_dtype)
        like = torch.empty(spec.shape(1), dtype=spec.dtype)

        def sample(rows, layer=layer, dtype=dtype, like=like):
            if op.name == "attention.decode":
                q, cache, metadata = backend._sample(layer, dtype, like, [37 * i % 90 for i in range(rows)], [1] * rows)
                return q, cache, metadata.decodes
            q, cache, metadata = backend._sample(layer, dtype, like, [rows // 2 + 3], [rows], prefill=True)
            return q, cache, metadata.chunk(0, layer.sliding_window)

        yield layer, sample, ()


EXAMPLES = {"dense.linear": _dense_examples, "dense.logits": _dense_examples, "dense.argmax": _argmax_examples, "gguf.linear": _gguf_examples, "gguf.linear.a8": _gguf_examples,
            "fp8.linear": _fp8_examples, "int.linear": _int_examples, "int.linear.a8": _int_examples, "int.logits": _int_examples,
            "int8.linear": _eight_bit_examples, "int8.linear.a8": _eight_bit_examples,
            "fp8.linear.a8": _eight_bit_examples, "fp8.logits": _eight_bit_examples, "int8.logits": _eight_bit_examples,
            "attention.decode": _attention_examples,
            "attention.prefill": _attention_examples}


def test_every_operation_has_examples():
    real = {name for name in kernels.operations() if not name.startswith("test.")}
    assert real <= EXAMPLES.keys(), f"operations without examples in this test: {real - EXAMPLES.keys()}"


@pytest.mark.parametrize("op_name", sorted(EXAMPLES))
def test_every_candidate_matches_the_reference_on_every_row_class(op_name):
    op = kernels.operations()[op_name]
    extra_args = not op_name.endswith(".logits")  # the LM head has no bias
    checked = set()
    for weight, sample, extra in EXAMPLES[op_name](op):
        reference = op.candidates[op.reference]
        key = _key(op_name, weight, sample)
        for candidate in op.supported(key):
            state, ref_state = candidate.prepare(weight), reference.prepare(weight)
            for rows in (*op.rows, 0, 3):
                if rows == 0 and op_name.startswith("attention."):  # a step has no empty decode or prefill
                    continue
                x, *inputs = sample(rows)
                args = (*inputs, *extra) if extra_args else ()
                out, ref = candidate.run(state, x, *args), reference.run(ref_state, x, *args)
                assert out.dtype == ref.dtype and out.shape == ref.shape, (candidate.name, rows)
                # The same products summed in another order, in bf16 or float32
                tol = 1e-4 if ref.dtype == torch.float32 else 3e-2
                torch.testing.assert_close(out.float(), ref.float(), atol=tol * 4, rtol=tol, msg=candidate.name)
            checked.add(candidate.name)
    assert op.reference in checked
    if shutil.which("c++") and os.environ.get("FW_NATIVE", "1") != "0":  # fw's portable kernels build anywhere
        assert NATIVE.get(op_name, set()) <= checked


# The native candidates every CPU with a compiler runs.
NATIVE = {"dense.linear": {"fw-plain", "fw-gemm"}, "dense.logits": {"fw-plain"}, "gguf.linear": {"fw", "fw-dequant"}, "gguf.linear.a8": {"fw"},
          "fp8.linear": {"fw"},
          "int.linear": {"fw"}, "int.linear.a8": {"fw"}, "int.logits": {"fw"}, "int8.linear": {"fw"}, "int8.linear.a8": {"fw"},
          "fp8.linear.a8": {"fw"}, "fp8.logits": {"fw"}, "int8.logits": {"fw"}, "attention.decode": {"fw"},
          "attention.prefill": {"fw"}}


def _key(op_name: str, weight, sample) -> tuple:
    if op_name.startswith("attention."):
        q, cache, *_ = sample(3)
        return torch_attention._key(weight, q.dtype, cache)
    if op_name == "dense.argmax":
        return dense._key(weight.packed)
    if op_name.startswith("dense"):
        return dense._key(weight)
    if op_name.startswith(("fp8.", "int8.")):
        return (*weight.weight.shape, weight.group, "bfloat16", "cpu")
    if op_name.startswith("int."):
        return packed.key(weight, torch.bfloat16)
    shards = tuple((s.qtype.name, s.rows) for s in weight.chunks)
    return shards, 256, str(sample(1)[0].dtype).removeprefix("torch."), "cpu"


def test_the_dense_candidates_this_cpu_runs(cache):
    """The candidates' own ``supports`` agree with what the machine has: a wrong one would crash or be skipped."""
    key = (96, 64, "bfloat16")
    names = {c.name for c in dense.LINEAR.supported(key)}
    assert {"torch", "torch-fp32"} <= names
    assert ("onednn" in names) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert ("fw-plain" in names) == native.load("fw_dense", dense._SOURCE)
    assert {c.name for c in dense.LINEAR.supported((96, 64, "float32"))} == {"torch"}
    # AMX tiles where the CPU has them and Linux grants them (5.16 and later, to any process that asks), never on
    # a width they skip
    flags = set(cpuinfo.read_text().split()) if (cpuinfo := Path("/proc/cpuinfo")).exists() else set()
    linux = tuple(int(v) for v in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
    amx = {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags and "fw-plain" in names and linux >= (5, 16)
    assert ("fw-amx" in names) == amx and ("fw-amx" in {c.name for c in dense.LOGITS.supported(key)}) == amx
    assert "fw-amx" not in {c.name for c in dense.LINEAR.supported((96, 48, "bfloat16"))}



@pytest.mark.parametrize("rows", [40, 1100])
def test_fw_amx_over_several_groups_of_columns(cache, rows):
    """fw-amx walks the columns in L2-sized groups of block pairs (smaller groups below 1024 rows), pads the rows
    to 32 and leaves out the second block of a last, odd pair: the examples above fit one group."""
    candidate = dense.LINEAR.candidates["fw-amx"]
    out_features, in_features = 560, 1024  # 35 blocks of 16 columns: several groups of pairs at either size
    if not candidate.supports((out_features, in_features, "bfloat16")):
        pytest.skip("fw-amx needs AMX-BF16 tiles, which this CPU or kernel does not grant")
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    out = candidate.run(candidate.prepare(weight), x, bias)
    ref = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=1e-2)

@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_amx_takes_every_integer_in_its_group_and_column(cache, bits):
    """fw-amx widens each 32 columns' integers into AMX tiles and scales each group's sums: with x one-hot rows at
    features of both groups, every output is its own integer times its group's scale plus its offset, exactly, so a
    misplaced feature, column or group shows; 40 rows pad to two 32-row tiles, 48 columns leave the last pair one
    block."""
    candidate = packed.PRODUCT.candidates["fw-amx"]
    out_features, in_features, group = 48, 256, 128
    g_idx = torch.arange(in_features) // group
    features = [0, 5, 67, 130, 255]
    q = torch.zeros(out_features, in_features, dtype=torch.uint8)
    for f in features:
        q[:, f] = (torch.arange(out_features) * 7 + f) % (1 << bits)
    zero = torch.tensor([[0.0, 2.0]]).expand(out_features, 2).contiguous()  # an offset of -2 scales in group 1
    columns = torch.arange(out_features)
    scale = torch.stack([0.5 ** (columns % 3 + 1), 0.5 ** (columns % 2 + 2)], 1)  # powers of two: exact products
    w = packed.repack(bits, q, zero, scale.half(), g_idx)
    if not candidate.supports(packed.key(w, torch.bfloat16)):
        pytest.skip("fw-amx needs AMX-BF16 tiles, which this CPU or kernel does not grant")
    rows = [features[i % len(features)] for i in range(40)]
    x = torch.zeros(40, in_features, dtype=torch.bfloat16)
    x[torch.arange(40), rows] = 1.0
    expected = torch.stack([q[:, f].float() * scale[:, 0] if f < group else (q[:, f].float() - 2.0) * scale[:, 1]
                            for f in rows])
    assert torch.equal(candidate.run(w, x), expected.bfloat16())


def test_the_gptq_wide_kernels_are_offered_where_the_cpu_has_avx512(cache):
    """The GPTQ kernels in 512-bit vectors are candidates exactly where the build targets them: fw-avx512 (float
    activations) with AVX-512, fw-vnni512 (int8 activations) with AVX-512 VNNI, fw-bf16 (prompts through the dense
    kernel's bf16 tiles) and fw-dpbf16 (4-bit bf16 pair products) with AVX512-BF16."""
    flags = set(cpuinfo.read_text().split()) if (cpuinfo := Path("/proc/cpuinfo")).exists() else set()
    weight = packed.round_rows(torch.randn(32, 256), bits=4, group=128)
    for op_name, wide, needs in (("int.linear", "fw-avx512", {"avx512f"}),
                                 ("int.linear.a8", "fw-vnni512", {"avx512_vnni", "avx512bw"}),
                                 ("int.linear", "fw-bf16", {"avx512_bf16"}),
                                 ("int.linear", "fw-dpbf16", {"avx512_bf16", "avx512bw"})):
        op = kernels.operations()[op_name]
        names = {c.name for c in op.supported(packed.key(weight, torch.bfloat16))}
        assert (wide in names) == ("fw" in names and needs <= flags), op_name


def test_fw_kernels_forces_the_attention_kernels_of_a_model(cache, monkeypatch, tmp_path):
    from fw import LLM, SamplingParams
    from fw.testing.models import make_tiny_model

    path = make_tiny_model("Qwen2ForCausalLM", tmp_path / "qwen2", dtype="bfloat16")
    chunks = []
    widened = torch_attention.PREFILL.candidates["torch-fp32"]
    monkeypatch.setitem(torch_attention.PREFILL.candidates, "torch-fp32", dataclasses.replace(
        widened, run=lambda layer, q, *args: chunks.append(len(q)) or widened.run(layer, q, *args)))
    monkeypatch.setenv("FW_KERNELS", "attention.prefill=torch-fp32,attention.decode=torch")
    llm = LLM(path, num_kv_blocks=64)
    prompt = list(range(1, 21))  # longer than the prompts that attend as decode rows (DECODE_QUERY_ROWS)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3
    chosen = [c for c in llm.llm_engine.executor.runner.attention._chosen if c is not None]
    assert chosen and all(c.prefill.names == ("torch-fp32",) * len(torch_attention.PREFILL_ROWS) for c in chosen)
    assert all(c.decode.names == ("torch",) * len(torch_attention.DECODE.rows) for c in chosen)
    assert chunks == [len(prompt)] * len(chosen)  # the prompt, once per layer


@pytest.mark.skipif(not native.load("fw_dense", dense._SOURCE), reason="no C++ compiler")
def test_the_plain_dense_kernel_on_ragged_shapes():
    """fw-plain's vector loop takes 16 input features at a time, 4 weight rows and up to 4 activation rows:
    every remainder of each, float32 and bf16 out (the latter its own float32 sum + bias, rounded to nearest even)."""
    gen = torch.Generator().manual_seed(0)
    for out_features, in_features in ((1, 1), (7, 15), (13, 16), (6, 33), (101, 130)):
        w = (0.1 * torch.randn(out_features, in_features, generator=gen)).bfloat16()
        bias = torch.randn(out_features, generator=gen).bfloat16()
        for rows in (0, 1, 2, 3, 4, 5, 6, 7, 9):
            x = torch.randn(in_features, rows, generator=gen).bfloat16().t()  # not contiguous
            ref = x.double() @ w.double().t()
            summed = torch.ops.fw_dense.plain_linear(x, w, None, True)
            assert summed.dtype == torch.float32 and summed.shape == (rows, out_features)
            torch.testing.assert_close(summed.double(), ref, atol=1e-5, rtol=1e-5)
            out = torch.ops.fw_dense.plain_linear(x, w, bias)
            assert out.dtype == torch.bfloat16
            assert torch.equal(out, (summed + bias.float()).bfloat16())
