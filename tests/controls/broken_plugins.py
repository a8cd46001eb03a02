"""Deliberately broken plugins, one per kind, each with a bug its conformance suite must catch.

``test_conformance_controls.py`` installs them (entry points in a throwaway site directory) and runs the suites
of ``suites.py`` against them. Each bug is one an author could make.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fw.interfaces import (
    attention,
    checkpoint_format,
    comm,
    kvconnector,
    quant,
    reasoning_parser,
    sampler,
    spec_proposer,
    tool_parser,
)
from fw.interfaces.base import Capabilities, frozen
from fw.interfaces.spec import PluginSpec
from fw.sdk.sampler import DefaultSampler
from fw.sdk.torch_distributed import TorchDistributed
from fw_reasoning_parsers.think import DeepSeekR1
from fw_tool_parsers.hermes import Hermes


def _spec(kind: str, module, record, impl: str, **capabilities) -> PluginSpec:
    return PluginSpec(
        name="broken", kind=kind, impl=f"broken_plugins:{impl}", capabilities=record(**capabilities),
        api_version=module.API_VERSION, description="A conformance control: fails its kind's suite.",
    )


class FixedBlockAttention(attention.AttentionBackend):
    """Reads the cache as if blocks always held 16 tokens: right at block size 16 only."""

    def forward(self, layer, q, k, v, kv_cache, metadata):
        kv_cache[0].view(-1, *k.shape[1:])[metadata.slot_mapping] = k
        kv_cache[1].view(-1, *v.shape[1:])[metadata.slot_mapping] = v
        out = torch.empty_like(q)
        starts = metadata.query_start_loc_cpu
        for i, seq_len in enumerate(metadata.seq_lens_cpu):
            rows = [b * 16 + o for b in metadata.block_tables[i].tolist() for o in range(16)][:seq_len]  # the bug
            keys, values = kv_cache[0].view(-1, *k.shape[1:])[rows], kv_cache[1].view(-1, *v.shape[1:])[rows]
            group = layer.num_heads // layer.num_kv_heads
            query = q[starts[i] : starts[i + 1]].transpose(0, 1)
            out[starts[i] : starts[i + 1]] = F.scaled_dot_product_attention(
                query, keys.repeat_interleave(group, 1).transpose(0, 1), values.repeat_interleave(group, 1).transpose(0, 1),
                attn_mask=torch.ones(len(query[0]), seq_len, dtype=torch.bool).tril(seq_len - len(query[0])),
                scale=layer.scale,
            ).transpose(0, 1)
        return out


class ForgetfulInt8Linear(quant.LinearMethod):
    """int8 per-row weights whose product forgets to multiply the scales back in, and branches in Python on its
    input's values (a captured decode step would replay one step's branch forever)."""

    def create_weights(self, layer, spec):
        shape = (sum(spec.output_sizes), spec.input_size)
        weight = torch.nn.Parameter(torch.empty(shape, dtype=spec.params_dtype), requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer):
        layer.qweight, layer.scale = quantize_rows(layer.weight)

    def apply(self, layer, x, bias=None):
        if x.abs().max().item() == 0:  # the second bug: a tensor's value read into Python
            return x.new_zeros(*x.shape[:-1], layer.qweight.shape[0])
        return F.linear(x, layer.qweight.to(x.dtype), bias)  # the bug: no "* layer.scale.T"


def quantize_rows(weight):
    """Symmetric int8 per output row: (int8 rows, [out, 1] scales)."""
    scale = weight.abs().amax(dim=1, keepdim=True) / 127
    return (weight / scale).round().to(torch.int8), scale


class ForgetfulInt8(quant.QuantMethod):
    def get_linear_method(self, spec):
        return ForgetfulInt8Linear()


class ReversedGather(TorchDistributed):
    """Concatenates the ranks' tensors in reverse order."""

    def all_gather(self, t, dim=-1):
        return torch.cat(list(reversed(super().all_gather(t, dim).chunk(self.world_size, dim))), dim)


class PartialBlocksScheduler(kvconnector.KVConnectorScheduler):
    """Offers every prompt token but the last, though nothing was saved (and its worker loads nothing)."""

    def get_num_new_matched_tokens(self, request_id, token_ids, num_computed_tokens, cache_keys=()):
        return len(token_ids) - num_computed_tokens - 1

    def update_state_after_alloc(self, request_id, block_ids, num_external_tokens):
        pass

    def build_connector_meta(self):
        return None


class NoopWorker(kvconnector.KVConnectorWorker):
    def start_load_kv(self, meta):
        pass

    def save_kv_layer(self, layer_idx, kv_cache, meta):
        pass


class GreedyIgnoringSampler(DefaultSampler):
    """Samples every row at temperature 1, the greedy ones (temperature 0) included."""

    def sample(self, logits, batch):
        gen = torch.Generator().manual_seed(0)
        return sampler.SamplerOutput(torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(1))


KV_CONNECTOR_IMPL = kvconnector.KVConnector(PartialBlocksScheduler, NoopWorker)


class OffByOneProposer(spec_proposer.SpecProposer):
    """Drafts the context's last k + 1 tokens: one more than the engine asked for."""

    def propose(self, requests):
        return [spec_proposer.Proposal(r.token_ids[-(r.k + 1) :]) for r in requests]  # the bug: k + 1


def write_single_file(plain, out):
    """A plain checkpoint as one ``.broken`` file: its safetensors, with config.json in the metadata."""
    path = out / "model.broken"
    save_file(load_file(plain / "model.safetensors"), path, metadata={"config": (plain / "config.json").read_text()})
    return path


class SwappedGateUp(checkpoint_format.CheckpointFormat):
    """Reads ``write_single_file``'s files, mapping a converter's gate and up projections the wrong way round."""

    def config(self, model_path):
        with safe_open(model_path, framework="pt") as f:
            return json.loads(f.metadata()["config"])

    def weights(self, model_path):
        swap = {"gate_proj": "up_proj", "up_proj": "gate_proj"}
        for name, tensor in load_file(model_path).items():
            parts = name.split(".")
            yield ".".join(swap.get(part, part) for part in parts), tensor  # the bug


class EagerHermes(Hermes):
    """Hermes' format, but it streams an open call at once, as content: it forgot that the call may yet complete."""

    settled = tool_parser.ToolParser.settled  # the bug


class TaglessThink(DeepSeekR1):
    """DeepSeek-R1's reasoning, but it declares no markers: a stream cut inside "</think>" sends the half tag."""

    markers = ()  # the bug

ATTENTION = _spec("attention", attention, attention.AttentionCapabilities, "FixedBlockAttention",
                  devices=frozen("cpu"), dtypes=frozen("float32"))
QUANT = _spec("quant", quant, quant.QuantCapabilities, "ForgetfulInt8", dtypes=frozen("float32"))
COMM = _spec("comm", comm, comm.CommCapabilities, "ReversedGather", devices=frozen("cpu"))
KV_CONNECTOR = _spec("kv_connector", kvconnector, kvconnector.KVConnectorCapabilities, "KV_CONNECTOR_IMPL")
SAMPLER = _spec("sampler", sampler, sampler.SamplerCapabilities, "GreedyIgnoringSampler")
SPEC_PROPOSERS = _spec("spec_proposers", spec_proposer, spec_proposer.SpecProposerCapabilities, "OffByOneProposer")
CHECKPOINT_FORMAT = _spec("checkpoint_format", checkpoint_format, checkpoint_format.CheckpointFormatCapabilities,
                          "SwappedGateUp", suffixes=frozen(".broken"))
TOOL_PARSERS = _spec("tool_parsers", tool_parser, Capabilities, "EagerHermes")
REASONING_PARSERS = _spec("reasoning_parsers", reasoning_parser, Capabilities, "TaglessThink")
