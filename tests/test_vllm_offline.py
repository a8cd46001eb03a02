"""vLLM's offline API on fw: each test is written as a vLLM user's script would be, and checks its outputs."""

from __future__ import annotations

import io
import time

import pytest
from tqdm import tqdm

from fw import LLM, SamplingParams, TextPrompt, TokensPrompt
from fw.engine import EngineError
from fw.logits_processors import bad_words_token_ids
from fw.outputs import Logprob, RequestMetrics
from fw.sdk.chat import ChatTemplateError
from fw.sdk.sampling_params import SamplingParamsError
from fw.testing.models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
TEXT = "The quick brown fox jumps over the lazy dog"
USER = [{"role": "user", "content": "Hello world"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("m") / "llama", dtype="float32")


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, num_kv_blocks=128, max_model_len=256)


@pytest.fixture(scope="module")
def hf_tokenizer(model):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i : i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def test_dict_prompts_single_list_and_mixed_give_the_plain_forms_tokens(llm):
    ids = llm.get_tokenizer().encode(TEXT)
    (single,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    expected = single.outputs[0].token_ids
    assert tokens(llm.generate(TEXT, GREEDY, use_tqdm=False)) == [expected]
    assert tokens(llm.generate([{"prompt_token_ids": ids}] * 2, GREEDY, use_tqdm=False)) == [expected] * 2
    mixed = llm.generate(
        [TEXT, TextPrompt(prompt=TEXT), TokensPrompt(prompt_token_ids=ids), ids, {"prompt": TEXT}], GREEDY,
        use_tqdm=False,
    )
    assert tokens(mixed) == [expected] * 5
    assert [o.prompt for o in mixed] == [TEXT, TEXT, None, None, TEXT]
    assert all(o.prompt_token_ids == ids for o in mixed)


@pytest.mark.parametrize("prompts", [42, [1.5], {"text": "x"}, [["a", "b"]], {"prompt_token_ids": "abc"}, None])
def test_other_prompt_forms_are_type_errors_naming_the_accepted_ones(llm, prompts):
    with pytest.raises(TypeError, match="TextPrompt .*TokensPrompt"):
        llm.generate(prompts, GREEDY, use_tqdm=False)


def test_multimodal_data_and_lora_are_clear_errors(llm):
    with pytest.raises(ValueError, match="multi_modal_data: fw serves text-only models"):
        llm.generate({"prompt": TEXT, "multi_modal_data": {"image": object()}}, use_tqdm=False)
    with pytest.raises(NotImplementedError, match="lora_request"):
        llm.generate(TEXT, lora_request=object(), use_tqdm=False)


def test_logprobs_are_logprob_objects(llm):
    out = llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1),
                       use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    for token, position in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True):
        chosen = position[token]
        assert isinstance(chosen, Logprob) and chosen.rank == 1 and chosen.logprob <= 0
        assert chosen.decoded_token == tok.decode([token], skip_special_tokens=False)
        assert sorted(lp.rank for lp in position.values()) == [1, 2]
    assert out.prompt_logprobs[0] is None
    assert all(out.prompt_token_ids[i] in pos for i, pos in enumerate(out.prompt_logprobs) if pos is not None)


def test_progress_bar_by_default_none_with_false_and_a_custom_class(llm, capsys):
    llm.generate([TEXT] * 2, GREEDY)
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate([TEXT] * 2, GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""
    bars = []

    def bar(**kwargs):
        bars.append(tqdm(**kwargs, file=io.StringIO()))
        return bars[-1]

    llm.generate([TEXT] * 3, GREEDY, use_tqdm=bar)
    assert [(b.total, b.n) for b in bars] == [(3, 3)]


def test_sampling_params_take_none_where_vllm_does(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, stop=None, stop_token_ids=None,
                            logit_bias=None, seed=None, bad_words=None, allowed_token_ids=None, logprobs=None,
                            prompt_logprobs=None, truncate_prompt_tokens=None)
    assert params.stop == [] and params.stop_token_ids == [] and params.bad_words == []
    greedy = tokens(llm.generate(TEXT, GREEDY, use_tqdm=False))[0]
    assert tokens(llm.generate(TEXT, params, use_tqdm=False)) == [greedy[:4]]
    with pytest.raises(SamplingParamsError, match="^allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(SamplingParamsError, match="^bad_words"):
        SamplingParams(bad_words=[" "])
    with pytest.raises(SamplingParamsError, match="^truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_allowed_token_ids_bound_greedy_and_sampled_outputs(llm):
    allowed = llm.get_tokenizer().encode(" the cat sat on a mat", add_special_tokens=False)
    (free,) = tokens(llm.generate(TEXT, GREEDY, use_tqdm=False))
    assert not set(free) <= set(allowed)  # the control: unconstrained, it leaves the set
    for params in (SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed),
                   SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed)):
        (out,) = tokens(llm.generate(TEXT, params, use_tqdm=False))
        assert len(out) == 24 and set(out) <= set(allowed)
    with pytest.raises(EngineError, match=r"allowed_token_ids: token ids \[512\] are outside"):
        llm.generate(TEXT, SamplingParams(allowed_token_ids=[3, 512]), use_tqdm=False)


def test_bad_words_are_never_generated_where_greedy_would_generate_them(llm):
    tok = llm.get_tokenizer()
    (free,) = tokens(llm.generate(TEXT, GREEDY, use_tqdm=False))
    # A two-token word the greedy output contains, so the ban has to match a prefix.
    spans = [free[i : i + 2] for i in range(len(free) - 1)]
    word = next(text for span in spans
                if (text := tok.decode(span)).strip().isalnum() and tok.encode(text, add_special_tokens=False) == span)
    banned = bad_words_token_ids(tok, [word])
    assert any(len(seq) == 2 and contains(free, seq) for seq in banned)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=[word])
    (out,) = tokens(llm.generate(TEXT, params, use_tqdm=False))
    assert out != free and not any(contains(out, seq) for seq in banned)


def test_priority_orders_admission_and_needs_the_priority_policy(model, llm):
    ordered = LLM(model, num_kv_blocks=64, max_model_len=256, scheduling_policy="priority", max_num_seqs=1)
    outs = ordered.generate(["first", "second", "third"], GREEDY, priority=[2, 0, 1], use_tqdm=False)
    assert [o.prompt for o in outs] == ["first", "second", "third"]
    started = [o.metrics.first_scheduled_time for o in outs]
    assert started[1] < started[2] < started[0]
    with pytest.raises(ValueError, match="priority scheduling policy"):
        llm.generate([TEXT, TEXT], GREEDY, priority=[0, 1], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # the accepted first prompt was withdrawn
    with pytest.raises(ValueError, match="2 prompts but 1 priorities"):
        llm.generate([TEXT, TEXT], GREEDY, priority=[0], use_tqdm=False)


def test_chat_content_parts_render_as_joined_text(llm, hf_tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    plain = [{"role": "user", "content": "Hello\nworld"}]
    a, b = llm.chat(parts, GREEDY, use_tqdm=False)[0], llm.chat(plain, GREEDY, use_tqdm=False)[0]
    assert a.prompt == b.prompt == hf_tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    assert a.prompt_token_ids == b.prompt_token_ids and a.outputs[0].token_ids == b.outputs[0].token_ids
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    with pytest.raises(ValueError, match="'image_url' is not supported"):
        llm.chat(image, use_tqdm=False)


def test_chat_continue_final_message_and_template_kwargs(llm, hf_tokenizer):
    messages = [*USER, {"role": "assistant", "content": "The quick"}]
    (out,) = llm.chat(messages, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert out.prompt == expected and expected.endswith("assistant\nThe quick")
    assert out.outputs[0].token_ids == tokens(llm.generate(
        {"prompt_token_ids": hf_tokenizer.encode(expected, add_special_tokens=False)}, GREEDY, use_tqdm=False))[0]
    with pytest.raises(ChatTemplateError, match="add_generation_prompt"):
        llm.chat(messages, GREEDY, use_tqdm=False, continue_final_message=True)
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (out,) = llm.chat(USER, GREEDY, use_tqdm=False, chat_template=template, chat_template_kwargs={"greeting": "Hi! "})
    assert out.prompt == "Hi! Hello world"


def test_tokenizer_answers_like_the_hugging_face_one(llm, hf_tokenizer):
    ours, hf = llm.get_tokenizer(), hf_tokenizer
    texts = [TEXT, "Grüße, 你好! <|im_end|>"]
    assert dict(ours(texts[0])) == dict(hf(texts[0])) and ours(texts[0]).input_ids == hf(texts[0]).input_ids
    assert dict(ours(texts)) == dict(hf(texts))
    ids = ours.encode(texts[1])
    assert ids == hf.encode(texts[1])
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert ours.batch_decode([ids, ids[:2]], skip_special_tokens=skip) == hf.batch_decode(
            [ids, ids[:2]], skip_special_tokens=skip)
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert ours.convert_ids_to_tokens(ids[0]) == hf.convert_ids_to_tokens(ids[0])
    assert ours.convert_tokens_to_ids(hf.convert_ids_to_tokens(ids)) == ids
    assert ours.convert_tokens_to_ids("<|im_end|>") == hf.convert_tokens_to_ids("<|im_end|>")
    assert ours.apply_chat_template(USER) == hf.apply_chat_template(USER, return_dict=False)
    assert ours.apply_chat_template(USER, add_generation_prompt=True, tokenize=False) == hf.apply_chat_template(
        USER, add_generation_prompt=True, tokenize=False)
    names = ("bos_token_id", "eos_token_id", "pad_token_id", "vocab_size")
    assert [getattr(ours, n) for n in names] == [getattr(hf, n) for n in names]
    assert len(ours) == len(hf)


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    ids = llm.get_tokenizer().encode(TEXT)
    out = llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, truncate_prompt_tokens=4),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-4:]
    assert out.outputs[0].token_ids == tokens(llm.generate([ids[-4:]], GREEDY, use_tqdm=False))[0]
    whole = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, truncate_prompt_tokens=-1)
    assert llm.generate(TEXT, whole, use_tqdm=False)[0].prompt_token_ids == ids


def test_detokenize_false_gives_token_ids_only(llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, detokenize=False, logprobs=0)
    comp = llm.generate(TEXT, params, use_tqdm=False)[0].outputs[0]
    assert comp.text == "" and comp.token_ids == tokens(llm.generate(TEXT, GREEDY, use_tqdm=False))[0]
    assert all(lp.decoded_token is None for pos in comp.logprobs for lp in pos.values())
    with pytest.raises(SamplingParamsError, match="^stop: needs detokenize=True"):
        SamplingParams(detokenize=False, stop=["x"])


def test_metrics_and_num_cached_tokens(llm):
    prompt = [(i * 7) % 500 + 3 for i in range(40)]  # 40 tokens: 2 full blocks of 16 can come from the cache
    before = time.time()
    (first,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    after = time.time()
    m = first.metrics
    assert isinstance(m, RequestMetrics)
    assert before <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
    assert m.last_token_time <= m.finished_time <= after
    assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)
    assert first.num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 32
    # A cache salt keeps prompts apart: a new salt misses, the same salt hits.
    salted = {"prompt_token_ids": prompt, "cache_salt": "tenant-a"}
    assert [llm.generate(salted, GREEDY, use_tqdm=False)[0].num_cached_tokens for _ in range(2)] == [0, 32]


def test_quantization_is_an_alias_of_quant(model):
    assert LLM(model, num_kv_blocks=64, max_model_len=256, quantization="none").llm_engine.selected["quant"] == "none"
    with pytest.raises(TypeError, match="two arguments for quant.name"):
        LLM(model, quant="none", quantization="none")
