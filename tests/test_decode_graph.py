"""Captured decode steps (``fw.decode_graph``): replays give the eager engine's tokens, and every guard that should
keep a step eager does."""

from __future__ import annotations

import logging

import pytest
import test_gguf as gguf_tests
import torch
from gguf import GGMLQuantizationType as Q

from fw import LLM, SamplingParams, decode_graph
from fw.layers.layernorm import RMSNorm
from fw.testing.conformance import assert_replayed, captured_against_eager
from fw.testing.models import make_tiny_model

# Different lengths, so a step's requests cross block boundaries (16 tokens) at different steps.
PROMPTS = ["The quick brown fox jumps over", "Hello", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15"]


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("graphs") / "llama", dtype="bfloat16")


def _run(path, **kwargs):
    """Greedy tokens of PROMPTS together (3-request steps) and of the first alone (1-request steps), and the
    engine's decode graphs."""
    llm = LLM(str(path), **{"num_kv_blocks": 64, "max_model_len": 128, **kwargs})
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    alone = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    graphs = llm.llm_engine.executor.runner.graphs
    llm.shutdown()
    return together + [alone], graphs


def _eager(path, **kwargs):
    tokens, graphs = _run(path, enforce_eager=True, **kwargs)
    assert graphs is None
    return tokens


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_replayed_steps_give_the_eager_tokens(bf16_llama, dtype):
    tokens, graphs = _run(bf16_llama, dtype=dtype)
    assert graphs.replayed == {(1, 1): 39 - 3, (3, 3): 39 - 3}  # every decode step but the warm-up, capture, check
    assert tokens == _eager(bf16_llama, dtype=dtype)


def test_large_batches_are_captured_once_their_size_has_run_many_steps(bf16_llama):
    llm = LLM(str(bf16_llama), num_kv_blocks=64, max_model_len=128)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    llm.generate([f"prompt number {i}" for i in range(10)], params, use_tqdm=False)
    graphs = llm.llm_engine.executor.runner.graphs
    llm.shutdown()
    # 39 decode steps of 10 requests: LARGE_RECURRENCE eager ones, the capture, the check, then replays
    assert decode_graph.SMALL_BATCH < 10 <= decode_graph.MAX_BATCH
    assert graphs.replayed == {(10, 10): 39 - decode_graph.LARGE_RECURRENCE - 2}


@pytest.mark.parametrize("qtype, options", [(Q.Q4_1, {}), (Q.Q8_0, {}), (Q.Q4_0, {"activations": "int8"})])
def test_captured_steps_of_gguf_models_give_the_eager_tokens(bf16_llama, tmp_path, qtype, options):
    """The GGUF conformance suite's checkpoint is Q8_0 with float shards (the dequantizing candidates): these add
    whole-model 4-bit and Q8_0 files on their native kernels, and int8 activations."""
    path = gguf_tests.write_gguf(bf16_llama, tmp_path / "tiny.gguf", qtype)
    graphs = captured_against_eager(path, plugin_options={"quant": options})
    assert graphs.off is None
    assert_replayed(graphs, qtype.name)


def _assert_stays_eager(path, caplog, why: str, **kwargs) -> None:
    """Nothing replays, the log says ``why``, and the tokens are the eager engine's."""
    with caplog.at_level(logging.INFO, logger="fw.decode_graph"):
        tokens, graphs = _run(path, **kwargs)
    assert graphs.replayed == {} and graphs.off.startswith(why)
    assert f"decode steps run eagerly: {why}" in caplog.text
    assert tokens == _eager(path, **kwargs)


def test_a_step_that_reads_a_tensor_into_python_stays_eager(bf16_llama, monkeypatch, caplog):
    forward = RMSNorm.forward

    def reads_a_value(self, x, residual=None):
        if x.sum().item() == float("inf"):  # never, but the trace cannot know
            raise AssertionError
        return forward(self, x, residual)

    monkeypatch.setattr(RMSNorm, "forward", reads_a_value)
    _assert_stays_eager(bf16_llama, caplog, "the step reads a tensor into Python")


def test_a_replay_that_differs_from_the_eager_step_is_dropped(bf16_llama, monkeypatch, caplog):
    from fw.models.llama import LlamaForCausalLM

    forward = LlamaForCausalLM.forward

    def doubles_while_traced(self, input_ids, positions):  # a host-side value (tracing or not): the trace keeps one
        hidden = forward(self, input_ids, positions)
        return hidden * 2 if torch.jit.is_tracing() else hidden  # twice the logits, exactly: the same tokens

    monkeypatch.setattr(LlamaForCausalLM, "forward", doubles_while_traced)
    _assert_stays_eager(bf16_llama, caplog, "the replay of a step of 3 requests and 3 tokens differs")


def test_a_backend_that_does_not_declare_graph_support_stays_eager(bf16_llama, monkeypatch, caplog):
    monkeypatch.setenv("FW_KERNELS", "attention.decode=torch")  # a gathering kernel: it sizes its work on the host
    _assert_stays_eager(bf16_llama, caplog, "the attention backend TorchAttention does not support them")


def test_steps_verifying_speculative_drafts_replay_and_give_the_eager_tokens(bf16_llama):
    """Each count of requests and tokens (a decode and its drafts) is captured; greedy output stays the eager
    engine's without speculation."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    tokens, graphs = _run(bf16_llama, speculative_config=ngram)
    verified = {shape: n for shape, n in graphs.replayed.items() if shape[1] > shape[0]}
    assert verified, f"no step verifying drafts replayed: {graphs.replayed}"
    assert tokens == _eager(bf16_llama)


def test_a_step_the_tracer_cannot_record_runs_eagerly_and_other_shapes_still_replay(bf16_llama, monkeypatch, caplog):
    trace = torch.jit.trace

    def fails_at_three_requests(step, inputs, **kwargs):  # as oneDNN's prepacked weights, where chosen
        if len(inputs[0]) == 3:
            raise RuntimeError("Unsupported value kind: Tensor")
        return trace(step, inputs, **kwargs)

    monkeypatch.setattr(torch.jit, "trace", fails_at_three_requests)
    with caplog.at_level(logging.INFO, logger="fw.decode_graph"):
        tokens, graphs = _run(bf16_llama)
    assert graphs.off is None and (3, 3) not in graphs.replayed and graphs.replayed[1, 1] > 0
    assert graphs.untraced == {(3, 3): "tracing the step failed (RuntimeError: Unsupported value kind: Tensor)"}
    assert "decode steps of 3 requests and 3 tokens run eagerly: tracing the step failed" in caplog.text
    assert tokens == _eager(bf16_llama)


def test_sizes_whose_chosen_kernels_a_trace_cannot_hold_are_not_traced(bf16_llama, monkeypatch, caplog):
    """oneDNN's prepacked weights, chosen (here by hand) for 3 rows and more: those steps run eagerly without a trace
    tried, said at INFO with the kernel named; one-request steps still replay; the tokens are the eager engine's."""
    from fw.sdk import dense, kernels

    def onednn_above_two_rows(key, weight, sample):
        names = tuple("onednn" if rows > 2 else "fw" for rows in dense.LINEAR.rows)
        return dense.LINEAR._build(key, weight, names, {c.name: c for c in dense.LINEAR.supported(key)})

    traced, trace = [], torch.jit.trace

    def counted(step, inputs, **kwargs):
        traced.append(len(inputs[0]))
        return trace(step, inputs, **kwargs)

    monkeypatch.setattr(dense.LINEAR, "select", onednn_above_two_rows)
    monkeypatch.setattr(torch.jit, "trace", counted)
    with caplog.at_level(logging.INFO, logger="fw.decode_graph"):
        tokens, graphs = _run(bf16_llama)
    why = "the kernels chosen for 3 rows (dense.linear/onednn) are not traceable"
    assert graphs.off is None and graphs.untraced == {(3, 3): why} and graphs.replayed[1, 1] > 0
    assert 3 not in traced and f"decode steps of 3 requests and 3 tokens run eagerly: {why}" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert kernels.untraceable(graphs.runner.model, 1) == []
    assert tokens == _eager(bf16_llama)
