"""Conformance tests every plugin of a kind must pass; built-ins run them too.

Subclass the class for your plugin's kind in a test module and name the
plugin; pytest then runs the whole suite against it::

    from fw.testing.conformance import SamplerConformance

    class TestMySampler(SamplerConformance):
        plugin = "my-sampler"
        options = {"strength": 0.5}

Kinds: ``AttentionConformance``, ``QuantConformance`` (give a ``QuantFixture``
per quant format: how to write a checkpoint in it, and how your method decodes it),
``CheckpointFormatConformance`` (a ``fixture`` writing a tiny model in your format),
``CommConformance``, ``KVConnectorConformance``, ``SamplerConformance``, ``SpecProposerConformance`` and
``HooksConformance`` (``plugin`` is the ``fw.hooks`` entry-point name). fw's own tests run every suite against a
deliberately broken plugin of its kind, which must fail it.

Numerical tests run on the first device the plugin supports that this host
has, and are skipped (saying why) when it has none.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F

from fw import distributed, model_registry, plugins, validate
from fw.interfaces import attention, checkpoint_format, comm, kvconnector, quant, sampler, spec_proposer
from fw.interfaces.sampler import SamplingBatch
from fw.interfaces.spec import PluginSpec, canonical_kind
from fw.sdk.sampling_params import SamplingParams

BASES: dict[str, type] = {
    "attention": attention.AttentionBackend,
    "quant": quant.QuantMethod,
    "comm": comm.Communicator,
    "sampler": sampler.Sampler,
    "checkpoint_format": checkpoint_format.CheckpointFormat,
    "spec_proposers": spec_proposer.SpecProposer,
}


def _host_devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


class PluginConformance:
    kind: ClassVar[str]
    plugin: ClassVar[str]
    options: ClassVar[dict[str, Any]] = {}

    @property
    def spec(self) -> PluginSpec:
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
        assert canonical_kind(spec.kind) == self.kind and spec.name == self.plugin
        assert isinstance(spec.capabilities, plugins.RECORDS[self.kind])
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


def dense_attention(q, k, v, positions_q, sliding_window=None, soft_cap=None):
    """Reference: q [Q,H,D] at ``positions_q`` over k/v [S,Hkv,D] at positions 0..S-1, causal, fp32."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.float().repeat_interleave(heads // kv_heads, dim=1)
    v = v.float().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) / math.sqrt(q.shape[-1])
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    key_pos = torch.arange(k.shape[0], device=q.device)
    allowed = key_pos[None, :] <= positions_q[:, None]
    if sliding_window:
        allowed &= key_pos[None, :] > positions_q[:, None] - sliding_window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class AttentionConformance(PluginConformance):
    """Paged attention against a dense reference, for every dtype and KV-cache dtype the backend declares and two
    block sizes; multi-head latent attention too for a backend declaring "mla".

    Three steps over four requests: prompts prefilled; then a chunk continuing a prompt (starting mid-block), a
    fresh prompt, a decode whose token opens a new block, and a prompt whose first block is another request's (a
    shared, cached prefix); then a decode-only step.
    """

    kind = "attention"
    head_size: ClassVar[int] = 64
    num_heads: ClassVar[tuple[int, int]] = (4, 2)  # query heads, KV heads: a GQA group of two
    # Two sizes catch a kernel that assumes one; a backend declaring block_sizes runs (up to two of) its own.
    block_sizes: ClassVar[tuple[int, ...]] = (16, 32)
    tolerances: ClassVar[dict[torch.dtype, float]] = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
    # A quantized cache against the unquantized reference (outputs are O(1)): twice what the torch backend needs.
    kv_cache_tolerances: ClassVar[dict[str, float]] = {"fp8": 0.2, "int8": 5e-2}
    # DeepSeek-V2's shape, scaled down (latent 64, rope 16, nope 32, values 32); a backend declaring mla_dims
    # sets one it takes.
    mla: ClassVar[attention.MLADims] = attention.MLADims(64, 16, 32, 32)

    def _cases(self) -> list[tuple[torch.dtype, int]]:
        caps = self.spec.capabilities
        sizes = sorted(caps.block_sizes)[:2] if caps.block_sizes else self.block_sizes
        return [(getattr(torch, d), b) for d in sorted(caps.dtypes) for b in sizes]

    @staticmethod
    def _layer(heads: int, kv_heads: int, head_size: int, kv_cache_dtype: str, **kwargs) -> attention.AttentionLayerSpec:
        # Per-layer scales other than 1, so that a kernel ignoring them fails.
        scales = {"k_scale": 0.5, "v_scale": 2.0} if kv_cache_dtype == "fp8" else {}
        return attention.AttentionLayerSpec(heads, kv_heads, head_size, head_size**-0.5, **kwargs, **scales)

    def _steps(self, dtype, b, kv_cache_dtype, layer, make, cached, attend, reference) -> None:
        """Run the three steps. ``make(total, gen)``: one request's per-token inputs; those at ``cached`` are what
        the cache holds (a shared prefix holds the same); ``attend(cache, meta, *inputs)`` runs the backend;
        ``reference(inputs, s, n)``: tokens s..s+n-1 of one request, from its float32 inputs."""
        device = self.device()
        backend = self.make()
        gen = torch.Generator().manual_seed(0)
        # Per request: its total tokens, and the (first token, count) it computes in each of the three steps.
        plan = {
            "chunked": (b + 10, [(0, b + 4), (b + 4, 5), (b + 9, 1)]),
            "late": (10, [None, (0, 9), (9, 1)]),
            "decode": (2 * b + 2, [(0, 2 * b), (2 * b, 1), (2 * b + 1, 1)]),
            "shared": (b + 4, [None, (b, 3), (b + 3, 1)]),  # its first b tokens are "chunked"'s first block
        }
        free = iter(torch.randperm(12, generator=gen).tolist())
        tables = {r: [next(free) for _ in range(-(-total // b))] for r, (total, _) in plan.items() if r != "shared"}
        tables["shared"] = [tables["chunked"][0], next(free)]
        inputs = {r: [t.to(dtype) for t in make(total, gen)] for r, (total, _) in plan.items()}
        for t in cached:
            inputs["shared"][t][:b] = inputs["chunked"][t][:b]
        spec = backend.kv_cache_spec(layer, b, dtype, kv_cache_dtype)
        # NaN, not zeros: slots a request has not written must never reach its output.
        cache = torch.full(spec.shape(12), float("nan"), device=device).to(spec.dtype)
        tol = max(self.tolerances[dtype], self.kv_cache_tolerances.get(kv_cache_dtype, 0.0))
        for step in range(3):
            batch = [(r, *steps[step]) for r, (_, steps) in plan.items() if steps[step] is not None]
            meta = attention.AttentionBatch.build(
                [tables[r][: -(-(s + n) // b)] for r, s, n in batch], [s for _, s, _ in batch], [n for *_, n in batch],
                b, device,
            )
            step_inputs = [torch.cat([inputs[r][i][s : s + n] for r, s, n in batch]).to(device)
                           for i in range(len(inputs["late"]))]
            out = attend(backend, cache, backend.prepare(meta), *step_inputs).float().cpu()
            row = 0
            for r, s, n in batch:
                torch.testing.assert_close(
                    out[row : row + n], reference([t.float() for t in inputs[r]], s, n), atol=tol, rtol=tol * 5,
                    msg=lambda m, r=r, step=step: (
                        f"{dtype}, {kv_cache_dtype} cache, block size {b}, step {step + 1}, request {r!r}: {m}"
                    ),
                )
                row += n

    def _check(self, dtype: torch.dtype, b: int, sliding_window: int | None, kv_cache_dtype: str = "auto",
               soft_cap: float | None = None) -> None:
        if self.spec.capabilities.mla_only:
            pytest.skip(f"{self.plugin} runs multi-head latent attention only")
        heads, kv_heads = self.num_heads
        d = self.head_size
        layer = self._layer(heads, kv_heads, d, kv_cache_dtype, sliding_window=sliding_window, logits_soft_cap=soft_cap)
        self._steps(
            dtype, b, kv_cache_dtype, layer,
            lambda total, gen: [torch.randn(total, h, d, generator=gen) for h in (heads, kv_heads, kv_heads)],
            (1, 2),
            lambda backend, cache, meta, q, k, v: backend.forward(layer, q, k, v, cache, meta),
            lambda qkv, s, n: dense_attention(*(t[: s + n] for t in qkv), torch.arange(n + s), sliding_window,
                                              soft_cap)[s:],
        )

    def _check_mla(self, dtype: torch.dtype, b: int, kv_cache_dtype: str = "auto") -> None:
        dims, heads = self.mla, self.num_heads[0]
        gen = torch.Generator().manual_seed(1)
        # Scaled so that each head's K and V are O(1), like the standard check's.
        w_uk = torch.randn(heads, dims.qk_nope_head_dim, dims.kv_lora_rank, generator=gen) / dims.kv_lora_rank**0.5
        w_uv = torch.randn(heads, dims.kv_lora_rank, dims.v_head_dim, generator=gen) / dims.kv_lora_rank**0.5
        layer = self._layer(heads, 1, dims.qk_nope_head_dim + dims.qk_rope_head_dim, kv_cache_dtype, mla=dims)

        def make(total, gen):
            return [torch.randn(total, heads, dims.qk_nope_head_dim, generator=gen),
                    torch.randn(total, heads, dims.qk_rope_head_dim, generator=gen),
                    torch.randn(total, dims.kv_lora_rank, generator=gen),
                    torch.randn(total, dims.qk_rope_head_dim, generator=gen)]

        def attend(backend, cache, meta, q_nope, q_pe, latent, k_pe):
            w = [t.to(device=cache.device, dtype=dtype) for t in (w_uk, w_uv)]
            return backend.forward_mla(layer, q_nope, q_pe, latent, k_pe, *w, cache, meta)

        def reference(inputs, s, n):
            q_nope, q_pe, latent, k_pe = (t[: s + n] for t in inputs)
            keys = torch.cat([(latent @ w_uk.transpose(1, 2)).transpose(0, 1), k_pe[:, None].expand(-1, heads, -1)], -1)
            values = (latent @ w_uv).transpose(0, 1)
            return dense_attention(torch.cat([q_nope, q_pe], -1), keys, values, torch.arange(s + n))[s:]

        self._steps(dtype, b, kv_cache_dtype, layer, make, (2, 3), attend, reference)

    def test_paged_attention_matches_dense(self) -> None:
        for dtype, block_size in self._cases():
            self._check(dtype, block_size, None)

    def test_sliding_window(self) -> None:
        if "sliding_window" not in self.spec.capabilities.features:
            pytest.skip(f"{self.plugin} does not declare sliding_window")
        for dtype, block_size in self._cases():
            self._check(dtype, block_size, 8)

    def test_soft_cap(self) -> None:
        if "soft_cap" not in self.spec.capabilities.features:
            pytest.skip(f"{self.plugin} does not declare soft_cap")
        for dtype, block_size in self._cases():
            # Random scores are O(1): a cap of 0.5 changes every probability, so a kernel ignoring it fails.
            self._check(dtype, block_size, None, soft_cap=0.5)

    def test_kv_cache_dtypes(self) -> None:
        quantized = sorted(self.spec.capabilities.kv_cache_dtypes - {"auto"})
        if not quantized:
            pytest.skip(f"{self.plugin} declares no KV-cache dtype but auto")
        for kv_cache_dtype in quantized:
            for dtype, block_size in self._cases():
                self._check(dtype, block_size, None, kv_cache_dtype)

    def test_captured_decode_steps_give_the_eager_tokens(self, tmp_path_factory) -> None:
        """A tiny model on this backend decodes with the eager engine's tokens when ``fw.decode_graph`` captures its
        steps (on the CPU, where steps are captured), in every KV-cache dtype the backend declares, at
        ``DECODE_BATCHES`` through preemptions and prefix hits. Where the backend declares decode graphs, steps of 1
        and 3 requests replay; where it does not, every step stays eager, for that reason alone."""
        from fw.testing.models import make_tiny_model

        if self.device() != "cpu":
            pytest.skip("decode steps are captured on the CPU only")
        caps = self.spec.capabilities
        if caps.mla_only:
            pytest.skip(f"{self.plugin} runs multi-head latent attention only")
        dtype = "bfloat16" if "bfloat16" in caps.dtypes else sorted(caps.dtypes)[0]
        path = make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("graphs") / "llama", dtype=dtype)
        for kv_cache_dtype in sorted(caps.kv_cache_dtypes):
            graphs = captured_against_eager(path, attention=self.plugin, kv_cache_dtype=kv_cache_dtype, dtype=dtype)
            if graphs.off is None:
                assert_replayed(graphs, kv_cache_dtype)
            else:
                assert graphs.replayed == {} and " does not support them" in graphs.off, f"{kv_cache_dtype}: {graphs.off}"

    def test_mla(self) -> None:
        """Multi-head latent attention against the expanded product: K = [latent W_UK^T, k_pe], V = latent W_UV,
        in every KV-cache dtype the backend declares."""
        if "mla" not in self.spec.capabilities.features:
            pytest.skip(f"{self.plugin} does not declare mla")
        for kv_cache_dtype in sorted(self.spec.capabilities.kv_cache_dtypes):
            for dtype, block_size in self._cases():
                self._check_mla(dtype, block_size, kv_cache_dtype)


def plain_checkpoint(plain: Path, _out: Path) -> Path:
    """The ``none`` format's checkpoint: the plain one as it is."""
    return plain


def plain_weights(checkpoint: Path, _options: Any) -> Iterable[tuple[str, torch.Tensor]]:
    """The ``none`` format's dequantized weights: the checkpoint's own."""
    from fw.sdk.checkpoint import iter_safetensors

    return iter_safetensors(checkpoint)


@dataclass(frozen=True)
class QuantFixture:
    """A small checkpoint of one format, the plugin's own float reading of it, and that reading's error."""

    # (a plain float32 checkpoint directory, an empty directory) -> a checkpoint of the same weights in the format
    build: Callable[[Path, Path], Path]
    # (that checkpoint, the plugin's parsed options) -> its Hugging Face-named tensors in float32 as the format
    # decodes them (a plugin that quantizes as it loads: the weights as it rounds them). The plugin's layers must
    # compute with exactly these weights, up to float rounding.
    dequantize: Callable[[Path, Any], Iterable[tuple[str, torch.Tensor]]]
    # The format's own error: the largest relative error |x Wd^T - x W^T| / |x W^T| (Frobenius norms) of any
    # linear layer, Wd dequantized and W the float weights.
    tolerance: float


class _DenseLinear(quant.LinearMethod):
    """The reference: float32 ``[out, in]`` weights, through the core's own weight loader."""

    def create_weights(self, layer, spec):
        weight = torch.nn.Parameter(torch.empty(sum(spec.output_sizes), spec.input_size), requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1
        layer.register_parameter("weight", weight)

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)


class _DenseReference(quant.QuantMethod):
    def get_linear_method(self, spec: quant.LinearSpec) -> quant.LinearMethod:
        return _DenseLinear()


def _reader(path: Path) -> checkpoint_format.CheckpointFormat:
    """The checkpoint format the engine reads ``path`` with."""
    return validate.checkpoint_format(str(path)).load()()


def _load(hf_config: dict, method: quant.QuantMethod, weights, dtype: torch.dtype, device: str):
    """The model as the engine loads it, with ``method``: every tensor through the layers' weight loaders."""
    from fw.model_loader import load_model
    from fw.models.base import HFConfig, ModelContext

    ctx = ModelContext(dtype=dtype, quant=method, attention=None)  # no forward pass: linear layers only
    return load_model(model_registry.resolve(hf_config).load(), HFConfig(hf_config), ctx, weights, device=device)


# The relative error a correct plugin's layers make against its dequantized weights: float32 summation order;
# 16-bit dtypes get their rounding on top.
_ROUNDING = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


# Decode steps of 1, 3, 8 and 17 requests: below, at and above the largest batch fw.decode_graph captures.
DECODE_BATCHES = (1, 3, 8, 17)


def decode_workload(llm: Any) -> tuple[list[list[int]], Any]:
    """Greedy tokens of ``DECODE_BATCHES`` batches of requests on one engine, every prompt 24 shared tokens and a
    short tail of its own (prefix-cache hits), and the engine's stats. The last batch's requests stop at different
    lengths, so it shrinks through smaller sizes; in a cache of 24 blocks of 16 tokens its 17 requests start
    together and then outgrow it (preemptions, and recomputes that hit the cache), while captured sizes replay."""
    prefix = [(7 * i + 3) % 200 + 10 for i in range(24)]
    tokens = []
    for n in DECODE_BATCHES:
        prompts = [{"prompt_token_ids": prefix + [(31 * n + 7 * j + t) % 200 + 10 for t in range(1 + j % 5)]}
                   for j in range(n)]
        params = [SamplingParams(max_tokens=8 + 3 * (j % 8) if n == DECODE_BATCHES[-1] else 12, temperature=0,
                                 ignore_eos=True) for j in range(n)]
        tokens += [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return tokens, llm.llm_engine.stats()


def assert_replayed(graphs: Any, what: str) -> None:
    """``decode_workload``'s steps of 1 and 3 requests replayed, and so did one of more than
    ``decode_graph.SMALL_BATCH`` (or the tracer could not record it: a kernel a trace cannot hold at that size)."""
    from fw import decode_graph

    assert graphs.replayed.keys() >= {(1, 1), (3, 3)}, f"{what}: {graphs.replayed}, untraced {graphs.untraced}"
    large = [size for size in {*graphs.replayed, *graphs.untraced} if size[0] > decode_graph.SMALL_BATCH]
    assert large, f"{what}: no step of more than {decode_graph.SMALL_BATCH} requests was captured: {graphs.replayed}"


def captured_against_eager(path: str | Path, **engine_args: Any) -> Any:
    """Runs ``decode_workload`` with captured decode steps and with ``enforce_eager``: the tokens must be equal
    (a replay repeats the eager step's kernels, so the math is the same), and both engines preempted and hit the
    prefix cache. Sizes above ``decode_graph.SMALL_BATCH`` are captured as soon as they recur, as small ones are,
    so that the workload's few steps of each replay too. Returns the captured engine's ``DecodeGraphStats``: what
    replayed, what the tracer could not record, and why capturing stopped, if it did."""
    from unittest import mock

    from fw import LLM, decode_graph

    args = {"num_kv_blocks": 24, "block_size": 16, "max_model_len": 128, **engine_args}
    runs = []
    for eager in (False, True):
        llm = LLM(str(path), enforce_eager=eager, **args)
        try:
            with mock.patch.object(decode_graph, "LARGE_RECURRENCE", 1):
                runs.append(decode_workload(llm))
        finally:
            llm.shutdown()
    (tokens, stats), (eager_tokens, eager_stats) = runs
    assert stats.decode_graphs is not None, "the engine captures no decode steps for this model"
    for s in (stats, eager_stats):
        assert s.num_preemptions > 0 and s.prefix_cache_hits > 0, s
    assert tokens == eager_tokens
    return stats.decode_graphs


class QuantConformance(PluginConformance):
    """Every linear layer of a tiny model, loaded from a checkpoint of each format the plugin declares (through the
    layers' weight loaders: fused q/k/v and gate/up shards, packed parameters), against the plugin's own
    dequantization of that checkpoint; and that dequantization against the float weights, within the format's
    tolerance."""

    kind = "quant"
    # Format -> its fixture. Every format in the spec's ``formats`` needs one; "none" defaults to the plain
    # checkpoint read as it is (a plugin that quantizes plain checkpoints gives its own).
    fixtures: ClassVar[dict[str, QuantFixture]] = {"none": QuantFixture(plain_checkpoint, plain_weights, 0.0)}
    architecture: ClassVar[str] = "LlamaForCausalLM"

    @pytest.fixture(scope="class")
    @classmethod
    def plain(cls, tmp_path_factory) -> Path:
        from fw.testing.models import make_tiny_model

        return make_tiny_model(cls.architecture, tmp_path_factory.mktemp("quant") / "plain")

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoints(cls, plain: Path, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
        """Format -> (its checkpoint, the config the engine reads for it)."""
        suite = cls()
        suite.device()  # skips where the plugin cannot run: writing and reading its format may need its dependencies
        out = {}
        for fmt in sorted(suite.spec.capabilities.formats & set(cls.fixtures)):
            path = cls.fixtures[fmt].build(plain, tmp_path_factory.mktemp(f"quant-{fmt}"))
            out[fmt] = path, _reader(path).config(str(path))
        return out

    def _dtypes(self, device: str) -> list[torch.dtype]:
        # On the CPU fw serves float16 checkpoints as bfloat16 (fw.validate), so float16 runs on CUDA only.
        names = sorted(self.spec.capabilities.dtypes - ({"float16"} if device == "cpu" else set()))
        return [getattr(torch, d) for d in names]

    def _dequantized(self, fmt: str, checkpoints) -> torch.nn.Module:
        path, config = checkpoints[fmt]
        weights = self.fixtures[fmt].dequantize(path, self.spec.parse_options(self.options))
        return _load(config, _DenseReference(), weights, torch.float32, "cpu")

    @staticmethod
    def _compare(model, reference, device: str, dtype: torch.dtype, tol: float, what: str) -> None:
        gen = torch.Generator().manual_seed(0)
        layers = [(n, m) for n, m in model.named_modules() if hasattr(m, "linear_method")]
        assert layers, "the model has no linear layers built by the quant method"
        for name, layer in layers:
            ref = reference.get_submodule(name)
            x = torch.randn(5, ref.spec.input_size, generator=gen)
            with torch.no_grad():
                expected, got = ref(x), layer(x.to(device, dtype)).float().cpu()
            error = ((got - expected).norm() / expected.norm()).item()
            assert error <= tol, f"{what}, {name}: relative error {error:.3g} > {tol:.3g}"

    def test_every_format_has_a_fixture(self) -> None:
        missing = sorted(self.spec.capabilities.formats - set(self.fixtures))
        assert not missing, f"set fixtures[format] = QuantFixture(build, dequantize, tolerance) for {', '.join(missing)}"

    def test_dequantized_weights_are_within_the_format_tolerance(self, plain: Path, checkpoints) -> None:
        float_weights = _load(model_registry.read_hf_config(str(plain)), _DenseReference(), plain_weights(plain, None),
                              torch.float32, "cpu")
        for fmt in checkpoints:
            tol = self.fixtures[fmt].tolerance
            self._compare(self._dequantized(fmt, checkpoints), float_weights, "cpu", torch.float32, tol,
                          f"{fmt} checkpoint dequantized against the float weights")

    def test_captured_decode_steps_give_the_eager_tokens(self, checkpoints, monkeypatch) -> None:
        """A model of every format decodes as ``fw.decode_graph`` captures it (on the CPU, where steps are
        captured) with the eager engine's tokens, at ``DECODE_BATCHES``, through preemptions and prefix hits; and
        steps of 1 and 3 requests replay: every candidate of the plugin's products is an op the tracer records.
        The core's float layers (what layers a plugin leaves in float, and the LM head) keep a candidate the tracer
        records, as oneDNN's prepacked weights, which kernel choice may time fastest, are not: tests/test_decode_graph
        covers those."""
        if self.device() != "cpu":
            pytest.skip("decode steps are captured on the CPU only")
        monkeypatch.setenv("FW_KERNELS", "dense.linear=torch,dense.logits=torch")
        dtypes = self._dtypes("cpu")
        dtype = torch.bfloat16 if torch.bfloat16 in dtypes else dtypes[0]  # a CPU's default for 16-bit checkpoints
        uncaptured = None
        for fmt, (path, _config) in checkpoints.items():
            graphs = captured_against_eager(path, quant=self.plugin, dtype=str(dtype).removeprefix("torch."),
                                            plugin_options={"quant": self.options})
            if graphs.off is not None and graphs.off.startswith("the attention backend"):
                uncaptured = graphs.off  # not the plugin's doing: the tokens were still checked
                continue
            assert graphs.off is None, f"{fmt}: capturing stopped: {graphs.off}"
            assert_replayed(graphs, fmt)
        if uncaptured:
            pytest.skip(f"no decode step was captured on this machine ({uncaptured}): only the tokens were checked")

    def test_linear_layers_match_the_dequantized_weights(self, checkpoints) -> None:
        device = self.device()
        impl, options = self.spec.load(), self.spec.parse_options(self.options)
        for fmt, (path, config) in checkpoints.items():
            reference = self._dequantized(fmt, checkpoints)
            for dtype in self._dtypes(device):
                method = impl(options, config.get("quantization_config"))
                model = _load(config, method, _reader(path).weights(str(path)), dtype, device)
                self._compare(model, reference, device, dtype, _ROUNDING[dtype], f"{fmt} checkpoint, {dtype}")


class CheckpointFormatConformance(PluginConformance):
    """A tiny model written in the format (``fixture``) is claimed by it, described by its config, and loads, through
    the quant method its config names, into the plain model: every linear layer within ``tolerance`` (the format's
    own rounding) of the plain one's product."""

    kind = "checkpoint_format"
    # (a plain float32 checkpoint directory, an empty directory) -> a checkpoint of the same model in the format.
    fixture: ClassVar[Callable[[Path, Path], Path]]
    # The largest relative error |x Wq^T - x W^T| / |x W^T| of a linear layer, as in ``QuantFixture``.
    tolerance: ClassVar[float] = 1e-5
    architecture: ClassVar[str] = "LlamaForCausalLM"
    # What the config must say as config.json does; the rest (dtypes, token ids) the format may know better.
    described: ClassVar[tuple[str, ...]] = (
        "architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
    )

    @pytest.fixture(scope="class")
    @classmethod
    def written(cls, tmp_path_factory) -> tuple[Path, Path]:
        """(the plain checkpoint, the same model in the format)."""
        from fw.testing.models import make_tiny_model

        cls().device()  # skips where the format's dependencies are missing: writing it may need them
        plain = make_tiny_model(cls.architecture, tmp_path_factory.mktemp("format") / "plain")
        return plain, cls.fixture(plain, tmp_path_factory.mktemp("format-written"))

    def _format(self) -> checkpoint_format.CheckpointFormat:
        return self.spec.load()()

    def test_claims_its_checkpoints_only(self, written) -> None:
        plain, path = written
        assert self.spec.capabilities.claims(str(path)), f"{path.name}: not one of {sorted(self.spec.capabilities.suffixes)}"
        assert not self.spec.capabilities.claims(str(plain)), "claims a plain model directory"

    def test_config_describes_the_model(self, written) -> None:
        plain, path = written
        config, expected = self._format().config(str(path)), model_registry.read_hf_config(str(plain))
        wrong = {key: (config.get(key), expected[key]) for key in self.described if config.get(key) != expected[key]}
        assert not wrong, f"config (got, config.json's): {wrong}"

    def test_weights_match_the_plain_model(self, written) -> None:
        plain, path = written
        reader = self._format()
        config = reader.config(str(path))
        model = _load(config, _quant_method(config), reader.weights(str(path)), torch.float32, "cpu")
        reference = _load(model_registry.read_hf_config(str(plain)), _DenseReference(), plain_weights(plain, None),
                          torch.float32, "cpu")
        QuantConformance._compare(model, reference, "cpu", torch.float32, self.tolerance, f"{path.name} against config.json's")


def _quant_method(config: dict) -> quant.QuantMethod:
    """The method of the highest-priority quant plugin that loads the quant format ``config`` names."""
    quant_config = config.get("quantization_config") or {}
    quant_format = quant_config.get("quant_method") or "none"
    specs = {s for s in plugins.available("quant").values() if quant_format in s.capabilities.formats}
    assert specs, f"no installed quant plugin loads {quant_format!r}, the quant format the config names"
    spec = max(specs, key=lambda s: s.priority)
    return spec.load()(spec.parse_options(None), quant_config)


# Every collective of fw.interfaces.comm.Communicator that _comm_worker exercises; the suite fails when the
# interface grows one that is not in this list.
EXERCISED = frozenset(
    {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "isend", "recv", "barrier",
     "exchange_counts", "dispatch", "combine", "new_groups"}
)


def _comm_worker(rank: int, world: int, port: int, kind: str, name: str, options: dict, queue) -> None:
    spec = plugins.get_spec(kind, name)
    impl = spec.load()
    impl.init_world(rank, world, f"tcp://127.0.0.1:{port}", "cpu", 60.0)
    group = impl(list(range(world)), rank, "cpu", spec.parse_options(options))
    results = {}
    results["all_reduce"] = group.all_reduce(torch.full((2, 3), float(rank + 1))).tolist()
    results["all_gather"] = group.all_gather(torch.full((2, 1), float(rank))).tolist()  # default dim: -1
    results["all_gather_0"] = group.all_gather(torch.tensor([float(rank)]), dim=0).tolist()
    results["reduce_scatter"] = group.reduce_scatter(torch.arange(4.0) + rank, dim=0).tolist()
    results["reduce_scatter_1"] = group.reduce_scatter(torch.arange(8.0).view(2, 4) + rank, dim=1).tolist()
    send = [1, 2] if rank == 0 else [3, 1]
    rows = (torch.arange(sum(send), dtype=torch.float32) + 10 * rank).unsqueeze(1).repeat(1, 2)
    recv = group.exchange_counts(send)
    results["exchange_counts"] = recv
    results["all_to_all"] = group.all_to_all(rows, send, recv)[:, 0].tolist()
    results["broadcast"] = group.broadcast(torch.tensor([float(rank)]), src=1).tolist()
    results["broadcast_0"] = group.broadcast(torch.tensor([float(rank + 5)]), src=0).tolist()
    buf = torch.zeros(2)
    if rank == 0:
        group.send(torch.tensor([7.0, 8.0]), dst=1)
        results["recv"] = group.recv(buf, src=1).tolist()
    else:
        results["recv"] = group.recv(buf, src=0).tolist()
        group.send(torch.tensor([9.0, 6.0]), dst=0)
    # isend: two in flight at once, completed by their handles, received in order.
    if rank == 0:
        for pending in [group.isend(torch.tensor([float(i), 1.0]), dst=1) for i in (3, 4)]:
            pending.wait()
    else:
        results["isend"] = [group.recv(torch.zeros(2), src=0).tolist() for _ in range(2)]
    # Each rank alone in a group of its own: a sum over it is the rank's own value.
    alone = impl.new_groups([[r] for r in range(world)], rank, "cpu", spec.parse_options(options))
    results["new_groups"] = (alone.ranks, alone.rank, alone.all_reduce(torch.ones(1)).tolist())
    # MoE dispatch/combine: 4 experts, 2 per rank. Rank 0's last token and rank 1's first and last choose experts
    # of one rank only; every other token is sent once to each rank.
    hidden = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    topk_ids = torch.tensor([[0, 3], [1, 2], [3, 2]] if rank == 0 else [[1, 0], [2, 3], [0, 1]])
    weights = torch.tensor([[0.5, 0.5], [0.25, 0.75], [0.9, 0.1]])
    sent = group.dispatch(hidden, topk_ids, weights, 4)
    mine = sent.topk_ids >= 0
    results["dispatch_rows"] = sent.hidden.shape[0]
    results["dispatch_local"] = bool((sent.topk_ids < 2).all() and (sent.topk_weights[~mine] == 0).all())
    # "Expert e multiplies by e + 1"; the experts weigh their outputs by the received weights, combine sums.
    scale = torch.where(mine, sent.topk_ids + 2 * rank + 1, 0).float()
    combined = group.combine(sent.hidden * (scale * sent.topk_weights).sum(1, keepdim=True), sent.handle)
    expected = (hidden.unsqueeze(1) * (topk_ids + 1).float().unsqueeze(-1) * weights.unsqueeze(-1)).sum(1)
    results["moe_ok"] = bool(torch.allclose(combined, expected, atol=1e-6))
    group.barrier()
    queue.put((rank, results))
    impl.destroy_world()


class CommConformance(PluginConformance):
    kind = "comm"

    def test_suite_covers_every_collective(self) -> None:
        methods = {name for name in dir(comm.Communicator) if not name.startswith("_")}
        uncovered = methods - EXERCISED - {"init_world", "destroy_world", "api_version"}
        assert not uncovered, f"fw.testing.conformance does not exercise {sorted(uncovered)}"

    def test_collectives_on_two_cpu_processes(self) -> None:
        if "cpu" not in self.spec.capabilities.devices:
            pytest.skip(f"{self.plugin} does not run on CPU; its GPU tests cover it")
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = distributed.free_port()
        procs = [
            ctx.Process(target=_comm_worker, args=(r, 2, port, self.kind, self.plugin, self.options, queue))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=60)
        r0, r1 = results[0], results[1]
        assert r0["all_reduce"] == [[3.0] * 3] * 2
        assert r1["all_gather"] == [[0.0, 1.0]] * 2 and r1["all_gather_0"] == [0.0, 1.0]
        assert r0["reduce_scatter"] == [1.0, 3.0] and r1["reduce_scatter"] == [5.0, 7.0]
        assert r0["reduce_scatter_1"] == [[1.0, 3.0], [9.0, 11.0]] and r1["reduce_scatter_1"] == [[5.0, 7.0], [13.0, 15.0]]
        assert r0["exchange_counts"] == [1, 3] and r1["exchange_counts"] == [2, 1]
        assert r0["all_to_all"] == [0.0, 10.0, 11.0, 12.0]
        assert r1["all_to_all"] == [1.0, 2.0, 13.0]
        assert r0["broadcast"] == r1["broadcast"] == [1.0] and r0["broadcast_0"] == r1["broadcast_0"] == [5.0]
        assert r0["recv"] == [9.0, 6.0] and r1["recv"] == [7.0, 8.0]
        assert r1["isend"] == [[3.0, 1.0], [4.0, 1.0]]
        assert r0["new_groups"] == ([0], 0, [1.0]) and r1["new_groups"] == ([1], 0, [1.0])
        assert r0["dispatch_rows"] == r1["dispatch_rows"] == 4  # each token once per rank owning its experts
        assert r0["dispatch_local"] and r1["dispatch_local"]  # local expert ids, -1 (weight 0) for others'
        assert r0["moe_ok"] and r1["moe_ok"]


class KVConnectorConformance(PluginConformance):
    """Drives both halves as the engine does: a producer computes a prompt's KV, a fresh consumer loads it.

    Override ``connector_options(role, tmp_path)`` to point both sides at one store or at each other.
    """

    kind = "kv_connector"
    BLOCK_SIZE: ClassVar[int] = 16
    PROMPT: ClassVar[list[int]] = list(range(1000, 1040))  # two full blocks and a partial one
    TIMEOUT: ClassVar[float] = 30.0  # seconds an asynchronous load or send may take

    def connector_options(self, role: str, tmp_path: Path) -> dict[str, Any]:
        """The options of one side (``role``: producer or consumer, set where the plugin has a role option);
        both sides share ``tmp_path``."""
        has_role = self.spec.options is not None and "role" in self.spec.options.model_fields
        return {**self.options, "role": role} if has_role else dict(self.options)

    def _halves(self, role: str, tmp_path: Path, caches: list[torch.Tensor]) -> tuple[Any, Any]:
        pair = self.spec.load()
        options = self.spec.parse_options(self.connector_options(role, tmp_path))
        scheduler, worker = pair.scheduler(options, self.BLOCK_SIZE), pair.worker(options)
        worker.register_kv_caches(caches)
        return scheduler, worker

    @staticmethod
    def _step(scheduler: Any, worker: Any, computes: bool) -> kvconnector.KVTransferReport:
        """One engine step on the worker side; one that computes nothing runs no layers (as the model runner)."""
        meta = scheduler.build_connector_meta()
        worker.start_load_kv(meta)
        if computes:
            for i, cache in enumerate(worker.kv_caches):
                worker.wait_for_layer_load(i)
                worker.save_kv_layer(i, cache, meta)
        worker.wait_for_save()
        return worker.get_finished()

    def _caches(self, fill: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        return [fill(2, 8, self.BLOCK_SIZE, 2, 8) for _ in range(2)]  # the default layout, 8 blocks, 2 layers

    def test_both_halves_implement_the_interface(self) -> None:
        pair = self.spec.load()
        assert isinstance(pair, kvconnector.KVConnector)
        assert issubclass(pair.scheduler, kvconnector.KVConnectorScheduler)
        assert issubclass(pair.worker, kvconnector.KVConnectorWorker)

    def test_nothing_is_offered_before_anything_is_saved(self, tmp_path: Path) -> None:
        scheduler, _ = self._halves("consumer", tmp_path, self._caches(torch.zeros))
        assert scheduler.get_num_new_matched_tokens("r", self.PROMPT, 0) == 0

    def test_saved_prompt_kv_loads_bit_exact_into_a_fresh_consumer(self, tmp_path: Path) -> None:
        bs, prompt = self.BLOCK_SIZE, self.PROMPT
        gen = torch.Generator().manual_seed(0)
        produced = self._caches(lambda *shape: torch.randn(*shape, generator=gen))
        producer, producer_worker = self._halves("producer", tmp_path, produced)
        p_blocks, c_blocks = [3, 5, 6], [1, 7, 2]
        keys = ("tenant-a",)  # the prompt's cache_salt
        producer.get_num_new_matched_tokens("r", prompt, 0, keys)
        producer.update_state_after_alloc("r", p_blocks, 0)
        producer.request_computed("r", prompt, p_blocks, len(prompt), keys)
        sent = "r" in self._step(producer, producer_worker, computes=True).sent
        held = producer.request_finished("r", p_blocks)

        consumed = self._caches(torch.zeros)
        consumer, consumer_worker = self._halves("consumer", tmp_path, consumed)
        # KV saved under other cache keys (another cache_salt, or none) never matches: the salt isolates tenants.
        for other in (("tenant-b",), ()):
            assert consumer.get_num_new_matched_tokens("other", prompt, 0, other) == 0, f"matched under keys {other}"
            consumer.request_finished("other", [])
        offered = consumer.get_num_new_matched_tokens("r", prompt, 0, keys)
        # Something must be offered, but never the last token: its logits give the first output token.
        assert 0 < offered < len(prompt), offered
        consumer.update_state_after_alloc("r", c_blocks, offered)
        consumer.request_computed("r", prompt, c_blocks, len(prompt), keys)
        report = self._step(consumer, consumer_worker, computes=not consumer.load_async)
        loaded = not consumer.load_async
        deadline = time.monotonic() + self.TIMEOUT
        while not (loaded and (sent or not held)):
            assert "r" not in report.failed, "the load failed"
            assert time.monotonic() < deadline, f"loaded: {loaded}, blocks held and not sent: {held and not sent}"
            loaded = loaded or "r" in report.loaded
            sent = sent or "r" in self._step(producer, producer_worker, computes=False).sent
            report = self._step(consumer, consumer_worker, computes=False)
        assert "r" not in report.failed
        for t in range(offered):
            src, dst = p_blocks[t // bs], c_blocks[t // bs]
            for before, after in zip(produced, consumed, strict=True):
                assert torch.equal(after[:, dst, t % bs], before[:, src, t % bs]), f"token {t}"
        # No block but those holding the loaded tokens was written (the rest of the last one may be).
        untouched = [b for b in range(8) if b not in c_blocks[: -(-offered // bs)]]
        for after in consumed:
            assert not after[:, untouched].any()


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


class SpecProposerConformance(PluginConformance):
    """Proposals an engine can verify (one per request, at most k tokens each, ids in the vocabulary, probabilities
    that are distributions holding the drafts), the lifecycle calls in any order, and greedy output through an
    engine token for token the same as without speculation. ``options`` must be complete (``model`` for a draft
    model); override ``context`` (what the proposer is built with) and ``target`` (the engine's model) where the
    tiny random Llama does not fit the proposer."""

    kind = "spec_proposers"
    num_speculative_tokens: ClassVar[int] = 3

    def target(self, tmp_path: Path) -> Path:
        from fw.testing.models import make_tiny_model

        return make_tiny_model("LlamaForCausalLM", tmp_path / "target")

    def context(self, tmp_path: Path) -> spec_proposer.ProposerContext:
        from fw.config import FwConfig
        from fw.model_registry import read_hf_config

        hf_config = read_hf_config(str(self.target(tmp_path)))
        return spec_proposer.ProposerContext(
            self.num_speculative_tokens, hf_config["vocab_size"], 256, "cpu", torch.float32, hf_config, FwConfig(),
        )

    def make(self, context: spec_proposer.ProposerContext) -> spec_proposer.SpecProposer:
        return self.spec.load()(self.spec.parse_options(self.options), context)

    @staticmethod
    def _requests(context: spec_proposer.ProposerContext, proposer) -> list[spec_proposer.ProposalRequest]:
        """A repetitive context (lookups find it), a random one and a one-token prompt, at k from 1 to 3."""
        gen = torch.Generator().manual_seed(0)
        contexts = [[5, 6, 7, 8, 9] * 6, torch.randint(context.vocab_size, (40,), generator=gen).tolist(), [11]]
        hidden = context.hf_config.get("hidden_size", 1)
        return [
            spec_proposer.ProposalRequest(
                f"r{i}", tokens, max(len(tokens) - 4, 1), k,
                torch.zeros(len(tokens) - 1, hidden) if proposer.needs_hidden_states else None,
            )
            for i, (tokens, k) in enumerate(zip(contexts, (3, 1, 2), strict=True))
        ]

    def test_proposals_respect_k_and_the_vocabulary(self, tmp_path: Path) -> None:
        context = self.context(tmp_path)
        proposer = self.make(context)
        assert proposer.num_speculative_tokens >= 1
        requests = self._requests(context, proposer)
        proposals = proposer.propose(requests)
        assert len(proposals) == len(requests), "one proposal per request, in order"
        for request, proposal in zip(requests, proposals, strict=True):
            tokens = list(proposal.token_ids)
            assert len(tokens) <= request.k, f"{request.request_id}: {len(tokens)} drafts for k={request.k}"
            assert all(isinstance(t, int) and 0 <= t < context.vocab_size for t in tokens), tokens
            if proposal.probs is not None and tokens:
                probs = proposal.probs
                assert probs.dtype == torch.float32 and tuple(probs.shape) == (len(tokens), context.vocab_size)
                torch.testing.assert_close(probs.sum(-1), torch.ones(len(tokens)), atol=1e-4, rtol=0)
                assert bool((probs[torch.arange(len(tokens)), torch.tensor(tokens)] > 0).all()), \
                    "a draft the proposer's own distribution gives probability 0"

    def test_lifecycle_calls_in_any_order(self, tmp_path: Path) -> None:
        context = self.context(tmp_path)
        proposer = self.make(context)
        requests = self._requests(context, proposer)
        proposals = proposer.propose(requests)
        for request, proposal in zip(requests, proposals, strict=True):
            proposer.accepted(request.request_id, len(proposal.token_ids), 0)
        proposer.remove_request(requests[0].request_id)
        proposer.remove_request("never-proposed")
        # A preempted request comes back under its id with every token it had.
        assert len(proposer.propose(requests[:1])) == 1

    def test_greedy_output_unchanged_through_an_engine(self, tmp_path: Path) -> None:
        from fw.llm import LLM
        from fw.sdk.sampling_params import SamplingParams

        target = str(self.target(tmp_path))
        prompts = ["a b c a b c a b c a b", "def f(x):\n    return x\n\ndef f(x):\n", "Hello"]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        args = {"num_kv_blocks": 64, "max_model_len": 256, "device": "cpu", "dtype": "float32"}
        outputs = []
        for speculative in (None, {"method": self.plugin, "num_speculative_tokens": self.num_speculative_tokens,
                                   **self.options}):
            llm = LLM(target, speculative_config=speculative, **args)
            try:
                outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            finally:
                llm.shutdown()
        assert outputs[1] == outputs[0]


class HooksConformance:
    """A hooks plugin: ``plugin`` is its ``fw.hooks`` entry-point name.

    Checks that it registers, imports light, returns what each hook's contract asks for, keeps the configuration
    valid when nothing of its own is set, and runs through an engine on a tiny model (``engine_args`` go to
    ``LLM()``), once per engine.
    """

    plugin: ClassVar[str]
    engine_args: ClassVar[dict[str, Any]] = {}

    def _only_mine(self, hook: str) -> Callable[..., list]:
        """Call ``hook`` on this plugin's implementation alone."""
        pm = plugins.get_plugin_manager()
        mine = pm.get_plugin(self.plugin)
        return pm.subset_hook_caller(hook, remove_plugins=[p for p in pm.get_plugins() if p is not mine])

    def test_listed_and_registered(self) -> None:
        (entry,) = [d for d in plugins.discover_hooks() if d.name == self.plugin]
        assert entry.status == "ok", entry.error
        assert entry.distribution, "register the plugin from an installed distribution"
        pm = plugins.get_plugin_manager()
        assert pm.get_hookcallers(pm.get_plugin(self.plugin)), "the plugin implements no fw_* hook"

    def test_imports_light(self) -> None:
        (entry,) = [d for d in plugins.discover_hooks() if d.name == self.plugin]
        module = entry.target.partition(":")[0]
        code = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == "[]", f"hooks plugins are imported whenever fw starts: keep {module} light " + (
            out.stdout + out.stderr
        )

    def test_hooks_keep_their_contracts(self, tmp_path: Path) -> None:
        from pydantic import BaseModel

        from fw.config import config_class, load_config
        from fw.interfaces.base import Requirements
        from fw.interfaces.hooks import CliOption

        for sections in self._only_mine("fw_config_sections")():
            for name, model in sections.items():
                assert isinstance(model, type) and issubclass(model, BaseModel), f"fw_config_sections: {name}"
                model()  # a section must validate with nothing set: installing the plugin never breaks a config
        fields = config_class().model_fields
        for options in self._only_mine("fw_cli_options")():
            for option in options:
                assert isinstance(option, CliOption), f"fw_cli_options returned {option!r}"
                section, _, leaf = option.path.partition(".")
                assert section in fields and leaf in fields[section].annotation.model_fields, (
                    f"fw_cli_options: {option.flag} sets {option.path}, which is not in the configuration"
                )
        config = load_config().config
        for problems in self._only_mine("fw_validate")(config=config, requirements=Requirements()):
            assert isinstance(problems, list) and all(isinstance(p, str) for p in problems), (
                f"fw_validate must return a list of strings, returned {problems!r}"
            )
        detected = self._only_mine("fw_detect_quant_format")(model_path=str(tmp_path), hf_config=None)
        assert detected is None or isinstance(detected, str), f"fw_detect_quant_format returned {detected!r}"
        default = self._only_mine("fw_default_model")()
        assert default is None or Path(default).exists(), f"fw_default_model returned {default!r}, which does not exist"
        logits_processors = self._only_mine("fw_logits_processors")
        for processors in logits_processors(request_id="0", sampling_params=SamplingParams(), engine=None):
            assert isinstance(processors, list) and all(map(callable, processors)), (
                f"fw_logits_processors must return a list of callables, returned {processors!r}"
            )

    def test_runs_with_engines(self, tmp_path: Path) -> None:
        from fw.llm import LLM
        from fw.testing.models import make_tiny_model

        model = make_tiny_model("LlamaForCausalLM", tmp_path / "llama")
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        for _ in range(2):  # two engines one after the other, as a test suite or a notebook runs them
            llm = LLM(str(model), num_kv_blocks=32, max_model_len=128, device="cpu", **self.engine_args)
            outputs = llm.generate(["Hello there", "The quick brown fox"], params, use_tqdm=False)
            llm.shutdown()
            assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]
