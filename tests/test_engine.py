"""The engine end to end: token-exact against transformers, batch invariance, preemption, prefix caching, TP."""

from __future__ import annotations

import json

import pytest
import torch

from fw import LLM, SamplingParams
from fw.engine import EngineError
from fw.sdk.errors import ModelLoadError
from fw.testing.models import ARCHITECTURES, make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
PROMPTS = ["Hello world, this is", "def fibonacci(n):\n    return", "Les élèves", "x"]


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(arch, root / arch) for arch in ARCHITECTURES}


def hf_greedy(path, prompt_ids: list[int], n: int) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids) :].tolist()


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_matches_transformers(models, arch):
    llm = LLM(models[arch], num_kv_blocks=64, max_num_batched_tokens=64)
    outputs = llm.generate(PROMPTS[:2], GREEDY)
    for out in outputs:
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == hf_greedy(models[arch], out.prompt_token_ids, 32)


@pytest.fixture(scope="module")
def reference(models):
    return tokens(LLM(models["Qwen2ForCausalLM"], num_kv_blocks=64).generate(PROMPTS, GREEDY))


@pytest.mark.parametrize(
    "settings",
    [
        {"max_num_batched_tokens": 1},
        {"max_num_batched_tokens": 7},
        {"max_num_batched_tokens": 64},
        {"max_num_batched_tokens": 7, "enable_prefix_caching": False},
        {"max_num_seqs": 1},
    ],
)
def test_batch_invariance(models, reference, settings):
    llm = LLM(models["Qwen2ForCausalLM"], num_kv_blocks=64, **settings)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == reference


def test_without_chunked_prefill_the_budget_must_hold_a_whole_prompt(models, reference):
    with pytest.raises(EngineError, match="--max-num-batched-tokens 64 is below max_model_len 128"):
        LLM(models["Qwen2ForCausalLM"], num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=64,
            enable_chunked_prefill=False)
    # Unset, the budget is the longest prompt's: every prompt runs whole, and the tokens are unchanged.
    llm = LLM(models["Qwen2ForCausalLM"], num_kv_blocks=64, enable_chunked_prefill=False)
    assert llm.llm_engine.scheduler.token_budget >= llm.llm_engine.max_model_len
    assert tokens(llm.generate(PROMPTS, GREEDY)) == reference


@pytest.mark.parametrize("unset", [{}, {"max_model_len": "auto"}, {"max_model_len": -1}])
def test_an_unset_context_length_is_lowered_to_what_the_kv_cache_holds(models, caplog, unset):
    # The tiny model's own length is 512; 5 blocks of 16 hold 80 tokens.
    with caplog.at_level("WARNING", logger="fw"):
        llm = LLM(models["Qwen2ForCausalLM"], num_kv_blocks=5, **unset)
    assert llm.llm_engine.max_model_len == 80
    assert "max_model_len 512 (the model's) lowered to 80" in caplog.text
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 80
    assert out.outputs[0].finish_reason == "length"
    # A length asked for is kept, or refused when the cache cannot hold it.
    with pytest.raises(EngineError, match="the KV cache holds 80 tokens, less than one sequence of max_model_len 96"):
        LLM(models["Qwen2ForCausalLM"], num_kv_blocks=5, max_model_len=96)


def test_one_at_a_time_with_prefix_cache_hits(models, reference):
    llm = LLM(models["Qwen2ForCausalLM"], num_kv_blocks=160, block_size=4)
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        assert tokens(llm.generate(prompt, GREEDY)) == [expected]
    # The same prompts again hit the cache and still give the same tokens.
    assert tokens(llm.generate(PROMPTS, GREEDY)) == reference
    assert llm.llm_engine.kv.prefix_cache_hits > 0


def test_preemption_gives_the_same_tokens(models, reference):
    # 8 blocks of 16 tokens cannot hold four requests of ~45 tokens at once.
    llm = LLM(models["Qwen2ForCausalLM"], num_kv_blocks=8, max_model_len=64)
    engine = llm.llm_engine
    preempted = []
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    done = {}
    while engine.has_unfinished_requests():
        preempted += [r.num_preemptions for r in engine.scheduler.running]
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert max(preempted) > 0, "the cache was large enough: no preemption happened"
    assert engine.stats().num_preemptions >= max(preempted)  # what fw:num_preemptions exports
    assert [done[i].outputs[0].token_ids for i in ids] == reference
    assert engine.kv.num_free_blocks() == 8


def test_prefix_cache_schedules_only_the_suffix(models):
    llm = LLM(models["LlamaForCausalLM"], num_kv_blocks=128, max_num_batched_tokens=1024, max_model_len=1024)
    engine = llm.llm_engine
    prefix = [(i * 7) % 500 + 3 for i in range(512)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(prefix + [5, 6, 7], one)
    engine.add_request(prefix + [9, 10, 11, 12, 13], one)
    batch = engine.scheduler.schedule()
    assert batch.num_new == [5] and batch.prefix_hit_tokens == 512
    assert engine.kv.prefix_cache_hits == 512
    assert engine.kv.prefix_cache_hit_rate() == pytest.approx(512 / (515 + 517))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3MoeForCausalLM"])
def test_tensor_parallel_matches_single_process(models, arch):
    prompts = PROMPTS[:3]
    single = tokens(LLM(models[arch], num_kv_blocks=64).generate(prompts, GREEDY))
    llm = LLM(models[arch], num_kv_blocks=64, tensor_parallel_size=2)
    try:
        assert tokens(llm.generate(prompts, GREEDY)) == single
    finally:
        llm.shutdown()


def test_seeded_sampling_is_reproducible(models):
    llm = LLM(models["LlamaForCausalLM"], num_kv_blocks=64)
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=16, ignore_eos=True)
    first = tokens(llm.generate(["Hello"], params))
    mixed = tokens(llm.generate(["Hello", "def x", "y"], [params, SamplingParams(temperature=1.0, max_tokens=8),
                                                         SamplingParams(temperature=0.7, seed=1, max_tokens=8)]))
    assert mixed[0] == first[0]


def test_bad_inputs_fail_with_named_problems(models, tmp_path):
    llm = LLM(models["LlamaForCausalLM"], num_kv_blocks=64, max_model_len=32)
    with pytest.raises(EngineError, match="prompt has 40 tokens, but max_model_len is 32"):
        llm.generate([[5] * 40], GREEDY)
    # Unknown architecture.
    odd = tmp_path / "odd"
    odd.mkdir()
    config = json.loads((models["LlamaForCausalLM"] / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "architectures": ["GPTBigThingForCausalLM"]}))
    with pytest.raises(EngineError, match="unsupported model architecture GPTBigThingForCausalLM; supported: .*LlamaForCausalLM"):
        LLM(odd)
    # Missing weights file.
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (empty / f).write_text((models["LlamaForCausalLM"] / f).read_text())
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(empty, num_kv_blocks=64)
    with pytest.raises(EngineError, match="does not exist"):
        LLM(tmp_path / "nowhere")
    with pytest.raises(TypeError, match="unknown argument"):
        LLM(models["LlamaForCausalLM"], max_num_seqz=3)
