"""Conformance tests every plugin of a kind must pass; built-ins run them too.

Subclass the class for your plugin's kind in a test module and name the
plugin; pytest then runs the whole suite against it::

    from fw.testing.conformance import SamplerConformance

    class TestMySampler(SamplerConformance):
        plugin = "my-sampler"
        options = {"strength": 0.5}

Numerical tests run on the first device the plugin supports that this host
has, and are skipped (saying why) when it has none.
"""

from __future__ import annotations

import math
import socket
from typing import Any, ClassVar

import pytest
import torch

from fw import plugins
from fw.interfaces import attention, comm, kvconnector, quant, sampler
from fw.interfaces.sampler import SamplingBatch
from fw.sampling_params import SamplingParams

RECORDS = {
    "attention": attention.AttentionCapabilities,
    "quant": quant.QuantCapabilities,
    "comm": comm.CommCapabilities,
    "kvconnector": kvconnector.KVConnectorCapabilities,
    "sampler": sampler.SamplerCapabilities,
}
BASES: dict[str, type] = {
    "attention": attention.AttentionBackend,
    "quant": quant.QuantMethod,
    "comm": comm.Communicator,
    "sampler": sampler.Sampler,
}


def _host_devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


class PluginConformance:
    kind: ClassVar[str]
    plugin: ClassVar[str]
    options: ClassVar[dict[str, Any]] = {}

    @property
    def spec(self) -> plugins.PluginSpec:
        return plugins.get_spec(self.kind, self.plugin)

    def device(self) -> str:
        usable = [d for d in _host_devices() if d in self.spec.capabilities.devices]
        if not usable:
            pytest.skip(
                f"{self.kind} plugin {self.plugin!r} needs {sorted(self.spec.capabilities.devices)}; this host has none"
            )
        missing = [m for m in self.spec.capabilities.requires_modules if not _importable(m)]
        if missing:
            pytest.skip(f"{self.kind} plugin {self.plugin!r} needs {', '.join(missing)}, not installed here")
        return usable[-1]

    def make(self, *args: Any) -> Any:
        impl = self.spec.load()
        return impl(*args, self.spec.parse_options(self.options))

    def test_spec_is_well_formed(self) -> None:
        spec = self.spec
        assert spec.kind == self.kind and spec.name == self.plugin
        assert isinstance(spec.capabilities, RECORDS[self.kind])
        assert spec.description, "describe the plugin in one sentence"
        assert spec.capabilities.devices, "declare at least one device"

    def test_listed_and_enabled(self) -> None:
        (entry,) = [d for d in plugins.discover(self.kind) if d.name == self.plugin]
        assert entry.status == "ok", entry.error
        assert entry.distribution, "register the plugin from an installed distribution"

    def test_options_validate(self) -> None:
        spec = self.spec
        spec.parse_options(self.options)
        if spec.options is not None:
            with pytest.raises(Exception, match="not_an_option"):
                spec.parse_options({**self.options, "not_an_option": 1})

    def test_implementation_loads(self) -> None:
        if self.spec.capabilities.requires_modules:
            self.device()  # skips when the implementation's own dependencies are absent
        impl = self.spec.load()
        if self.kind in BASES:
            assert issubclass(impl, BASES[self.kind])
            assert impl.api_version in (self.spec.api_version, self.spec.api_version - 1)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def dense_attention(q, k, v, positions_q, sliding_window=None):
    """Reference: q [Q,H,D] at ``positions_q`` over k/v [S,Hkv,D] at positions 0..S-1, causal, fp32."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.float().repeat_interleave(heads // kv_heads, dim=1)
    v = v.float().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) / math.sqrt(q.shape[-1])
    key_pos = torch.arange(k.shape[0])
    allowed = key_pos[None, :] <= positions_q[:, None]
    if sliding_window:
        allowed &= key_pos[None, :] > positions_q[:, None] - sliding_window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class AttentionConformance(PluginConformance):
    kind = "attention"
    head_size: ClassVar[int] = 64

    def _run_two_steps(self, sliding_window: int | None) -> None:
        device = self.device()
        # fp32 where the backend has it (tight check); bf16 kernels are compared within bf16 rounding.
        dtype = torch.float32 if "float32" in self.spec.capabilities.dtypes else torch.bfloat16
        atol = 2e-5 if dtype is torch.float32 else 3e-2
        backend = self.make()
        gen = torch.Generator().manual_seed(0)
        heads, kv_heads, block = 4, 2, 16
        layer = attention.AttentionLayerSpec(heads, kv_heads, self.head_size, self.head_size**-0.5, sliding_window)
        num_blocks = 16
        cache = torch.zeros(
            backend.kv_cache_shape(num_blocks, block, kv_heads, self.head_size), dtype=dtype, device=device
        )
        # (cached context, new tokens): a chunk continuing a prompt, a fresh prompt, a decode.
        shapes = [(20, 5), (0, 9), (30, 1)]
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        tables = [perm[0:2], perm[2:3], perm[3:5]]
        total = [c + n for c, n in shapes]
        qkv = [
            tuple(
                torch.randn(s, h, self.head_size, generator=gen, dtype=torch.float32)
                for h in (heads, kv_heads, kv_heads)
            )
            for s in total
        ]

        def step(starts: list[int], counts: list[int]) -> torch.Tensor:
            batch = attention.AttentionBatch.build(tables, starts, counts, block, device)
            q, k, v = (
                torch.cat([t[i][s : s + n] for t, s, n in zip(qkv, starts, counts, strict=True)]).to(device, dtype)
                for i in range(3)
            )
            return backend.forward(layer, q, k, v, cache, backend.prepare(batch)).float().cpu()

        step([0] * 3, [c for c, _ in shapes])  # write the cached context
        out = step([c for c, _ in shapes], [n for _, n in shapes])
        row = 0
        for (ctx, new), (q, k, v) in zip(shapes, qkv, strict=True):
            q, k, v = (t.to(dtype).float() for t in (q, k, v))
            expected = dense_attention(q[ctx:], k, v, torch.arange(ctx, ctx + new), sliding_window)
            torch.testing.assert_close(out[row : row + new], expected, atol=atol, rtol=atol * 5)
            row += new

    def test_paged_prefill_and_decode_match_dense(self) -> None:
        self._run_two_steps(None)

    def test_sliding_window(self) -> None:
        if "sliding_window" not in self.spec.capabilities.features:
            pytest.skip(f"{self.plugin} does not declare sliding_window")
        self._run_two_steps(8)


class QuantConformance(PluginConformance):
    kind = "quant"

    def test_linear_method_creates_shardable_parameters(self) -> None:
        if "none" not in self.spec.capabilities.formats:
            pytest.skip("needs a checkpoint of the plugin's own format; covered by the plugin's tests")
        method = self.make().get_linear_method("layer")
        layer = torch.nn.Module()
        method.create_weights(layer, 32, [16, 8], torch.float32)
        params = dict(layer.named_parameters())
        assert params, "create_weights registered no parameters"
        for name, param in params.items():
            assert hasattr(param, "output_dim") and hasattr(param, "input_dim"), name
        weight = torch.randn(24, 32)
        layer.weight.data.copy_(weight)
        method.process_weights_after_loading(layer)
        x = torch.randn(3, 32)
        torch.testing.assert_close(method.apply(layer, x), x @ weight.T)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _comm_worker(rank: int, world: int, port: int, kind: str, name: str, options: dict, queue) -> None:
    spec = plugins.get_spec(kind, name)
    impl = spec.load()
    impl.init_world(rank, world, f"tcp://127.0.0.1:{port}", "cpu", 60.0)
    group = impl(list(range(world)), rank, "cpu", spec.parse_options(options))
    results = {}
    t = torch.full((4,), float(rank + 1))
    results["all_reduce"] = group.all_reduce(t.clone()).tolist()
    results["all_gather"] = group.all_gather(torch.tensor([float(rank)]), dim=0).tolist()
    results["reduce_scatter"] = group.reduce_scatter(torch.arange(4.0) + rank, dim=0).tolist()
    send = [1, 2] if rank == 0 else [3, 1]
    rows = torch.arange(sum(send), dtype=torch.float32) + 10 * rank
    recv = group.exchange_counts(send)
    results["all_to_all"] = group.all_to_all(rows, send, recv).tolist()
    results["broadcast"] = group.broadcast(torch.tensor([float(rank)]), src=1).tolist()
    buf = torch.zeros(2)
    if rank == 0:
        group.send(torch.tensor([7.0, 8.0]), dst=1)
    else:
        group.recv(buf, src=0)
    results["recv"] = buf.tolist()
    # MoE dispatch/combine: 4 experts, 2 per rank; combine must equal the dense weighted sum.
    hidden = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    topk_ids = torch.tensor([[0, 3], [1, 2], [3, 0]])
    weights = torch.tensor([[0.5, 0.5], [0.25, 0.75], [1.0, 0.0]])
    recv_hidden, experts, handle = group.dispatch(hidden, topk_ids, 4)
    scale = (experts + 1).float().unsqueeze(-1)  # "expert e multiplies by e + 1"
    combined = group.combine(recv_hidden * scale, handle, weights)
    expected = (hidden.unsqueeze(1) * (topk_ids + 1).float().unsqueeze(-1) * weights.unsqueeze(-1)).sum(1)
    results["moe_ok"] = bool(torch.allclose(combined, expected, atol=1e-6))
    group.barrier()
    queue.put((rank, results))
    impl.destroy_world()


class CommConformance(PluginConformance):
    kind = "comm"

    def test_collectives_on_two_cpu_processes(self) -> None:
        if "cpu" not in self.spec.capabilities.devices:
            pytest.skip(f"{self.plugin} does not run on CPU; its GPU tests cover it")
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = _free_port()
        procs = [
            ctx.Process(target=_comm_worker, args=(r, 2, port, self.kind, self.plugin, self.options, queue))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=60)
        assert results[0]["all_reduce"] == [3.0] * 4
        assert results[1]["all_gather"] == [0.0, 1.0]
        assert results[0]["reduce_scatter"] == [1.0, 3.0] and results[1]["reduce_scatter"] == [5.0, 7.0]
        assert results[0]["all_to_all"] == [0.0, 10.0, 11.0, 12.0]
        assert results[1]["all_to_all"] == [1.0, 2.0, 13.0]
        assert results[0]["broadcast"] == [1.0]
        assert results[1]["recv"] == [7.0, 8.0]
        assert results[0]["moe_ok"] and results[1]["moe_ok"]


class KVConnectorConformance(PluginConformance):
    kind = "kvconnector"

    def test_both_halves_implement_the_interface(self) -> None:
        pair = self.spec.load()
        assert isinstance(pair, kvconnector.KVConnector)
        assert issubclass(pair.scheduler, kvconnector.KVConnectorScheduler)
        assert issubclass(pair.worker, kvconnector.KVConnectorWorker)
        options = self.spec.parse_options(self.options)
        sched = pair.scheduler(options, 16)
        assert sched.get_num_new_matched_tokens("r0", list(range(40)), 0) % 16 == 0
        pair.worker(options).register_kv_caches([torch.zeros(2, 4, 16, 1, 8)])


class SamplerConformance(PluginConformance):
    kind = "sampler"

    def _batch(self, params: list[SamplingParams]) -> SamplingBatch:
        gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
        return SamplingBatch(
            request_ids=[str(i) for i in range(len(params))],
            params=params,
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            all_greedy=all(p.greedy for p in params),
            generators=gens,
            prompt_token_ids=[[1, 2, 3]] * len(params),
            output_token_ids=[[]] * len(params),
        )

    def test_greedy_rows_take_the_argmax(self) -> None:
        logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
        params = [SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=1.0) for i in range(6)]
        out = self.make().sample(logits, self._batch(params))
        assert out.token_ids.shape == (6,)
        assert out.token_ids[0::2].tolist() == logits[0::2].argmax(-1).tolist()

    def test_samples_stay_in_the_support(self) -> None:
        logits = torch.full((8, 50), float("-inf"))
        logits[:, [3, 17, 41]] = torch.randn(8, 3, generator=torch.Generator().manual_seed(2))
        out = self.make().sample(logits, self._batch([SamplingParams(temperature=1.0)] * 8))
        assert set(out.token_ids.tolist()) <= {3, 17, 41}

    def test_seeded_row_does_not_depend_on_the_batch(self) -> None:
        sampler_impl = self.make()
        logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
        seeded = SamplingParams(temperature=1.0, seed=1234)
        tokens = []
        for others in ([], [SamplingParams(temperature=0.8)] * 4, [SamplingParams(temperature=1.0, seed=7)] * 4):
            rows = [logits[0]] + [logits[i + 1] for i in range(len(others))]
            tokens.append(sampler_impl.sample(torch.stack(rows), self._batch([seeded, *others])).token_ids[0].item())
        assert len(set(tokens)) == 1, tokens
