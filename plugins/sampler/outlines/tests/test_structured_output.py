"""Structured output with the outlines sampler: end to end on a random-weight model, where only the
constraint can make the text valid, plus the sampler's pieces (vocabulary bytes, regexes, lifecycle) on their own."""

from __future__ import annotations

import contextlib
import json
import re

import jsonschema
import psutil
import pytest
import torch
from tokenizers import AddedToken, decoders, models
from tokenizers import Tokenizer as HFTokenizer

from conftest import wait_until
from fw import LLM, SamplingParams
from fw.interfaces.sampler import RequestError, SamplingBatch
from fw.sdk import workers
from fw.sdk.tokenizer import Tokenizer
from fw.testing.conformance import SamplerConformance
from fw.testing.models import make_tiny_model
from fw_sampler_outlines.constraints import bounded_number_regex, check_regex, choice_regex, schema_regex
from fw_sampler_outlines.sampler import OutlinesSampler
from fw_sampler_outlines.spec import OutlinesOptions
from fw_sampler_outlines.vocab import token_bytes


class TestOutlinesConformance(SamplerConformance):
    plugin = "outlines"


SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 8},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 8},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                    },
                },
                "required": ["name", "address"],
            }
        },
        "required": ["user"],
    },
    "arrays": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 3},
            "grid": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
                "minItems": 1,
                "maxItems": 2,
            },
        },
        "required": ["tags", "grid"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "XL"]},
            "note": {"anyOf": [{"type": "null"}, {"const": "n/a"}]},
        },
        "required": ["color", "size", "note"],
    },
    "bounds": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
            "delta": {"type": "integer", "minimum": -1000, "maximum": -10},
            "temp": {"type": "number", "minimum": -50, "maximum": 50},
        },
        "required": ["age", "score", "delta", "temp"],
    },
    "required": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "name": {"type": "string", "minLength": 1, "maxLength": 6},
            "active": {"type": "boolean"},
            "nickname": {"type": "string", "maxLength": 4},
        },
        "required": ["id", "name", "active"],
        "additionalProperties": False,
    },
}
EMAIL = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
PHONE = r"\+1 \([0-9]{3}\) [0-9]{3}-[0-9]{4}"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, sampler="outlines", num_kv_blocks=2048, max_model_len=512)


@pytest.fixture(scope="module")
def tokenizer(model):
    return Tokenizer.from_dir(str(model))


def sampled(seed: int, **constraint) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=256, structured_outputs=constraint)


# --- end to end ------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(llm, name):
    schema = SCHEMAS[name]
    outputs = llm.generate(["Output:"] * 100, [sampled(i, json=schema) for i in range(100)])
    texts = [o.outputs[0].text for o in outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 50, "temperature 1 with different seeds should give varied outputs"


def test_regex_outputs_fullmatch(llm):
    params = [sampled(i, regex=EMAIL) for i in range(100)] + [sampled(i, regex=PHONE) for i in range(100)]
    outputs = llm.generate(["Contact:"] * 200, params)
    for out, pattern in zip(outputs, [EMAIL] * 100 + [PHONE] * 100, strict=True):
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"


def test_choice_and_json_object(llm):
    choices = ["yes", "no", "maybe"]
    outputs = llm.generate(["Well?"] * 30, [sampled(i, choice=choices) for i in range(30)])
    assert {o.outputs[0].text for o in outputs} <= set(choices)
    # Random weights rarely close a free-form string; a bias towards '"' and '}' (applied before the mask) does.
    closing = {llm.get_tokenizer().token_to_id(t): 8.0 for t in ('"', "}")}
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=256, logit_bias=closing, structured_outputs={"json_object": True}
        )
        for i in range(20)
    ]
    outputs = llm.generate(["{"] * 20, params)
    assert all(isinstance(json.loads(o.outputs[0].text), dict) for o in outputs)


def test_unconstrained_requests_in_a_mixed_batch_match_the_default_sampler(llm, model):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["Hello world, this is", "def fibonacci(n):", "Les élèves", "x"]
    constrained = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs={"json": SCHEMAS["enums"]})
    mixed = llm.generate(prompts * 2, [greedy] * 4 + [constrained] * 4)
    reference = LLM(model, sampler="default", num_kv_blocks=256).generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in reference]
    for out in mixed[4:]:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS["enums"])


def test_preempted_requests_stay_valid(model):
    # 10 blocks of 16 tokens cannot hold 8 requests of ~40 tokens: some are preempted and recomputed.
    llm = LLM(model, sampler="outlines", num_kv_blocks=10, max_model_len=128)
    engine = llm.llm_engine
    schema = SCHEMAS["required"]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=100, structured_outputs={"json": schema}) for i in range(8)
    ]
    ids = [engine.add_request("Record:", p) for p in params]
    done, preempted = {}, []
    while engine.has_unfinished_requests():
        preempted += [r.num_preemptions for r in engine.scheduler.running]
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert max(preempted) > 0, "no preemption happened"
    for request_id in ids:
        jsonschema.validate(json.loads(done[request_id].outputs[0].text), schema)


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        ({"json": '{"type": "object",'}, "invalid JSON schema: not JSON"),
        ({"json": {"type": "objekt"}}, "invalid JSON schema: 'objekt' is not valid"),
        ({"json": {"type": "integer", "minimum": "zero"}}, "invalid JSON schema: 'zero' is not of type 'number'"),
        ({"json": {"not": {"type": "string"}}}, "unsupported JSON schema"),
        ({"regex": "[a-z"}, "invalid regex: unterminated character set"),
        ({"regex": "(a)\\1"}, "invalid regex: backreferences are not supported"),
        ({"regex": "^abc$"}, "invalid regex: anchors"),
    ],
)
def test_invalid_constraints_are_rejected_before_admission(llm, constraint, message):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate("x", SamplingParams(structured_outputs=constraint))
    assert not engine.has_unfinished_requests()


def test_compile_failure_fails_the_call_and_leaves_the_engine_clean(llm):
    # Python accepts the lookahead inside the schema's pattern; only outlines-core's compiler rejects it.
    schema = {"type": "string", "pattern": "a(?=b)"}
    with pytest.raises(RequestError, match="failed to compile"):
        llm.generate(["x", "y"], [sampled(0, json=schema), SamplingParams(max_tokens=2)])
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate("x", SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


# --- the sampler on hand-built batches ----------------------------------------------


def batch_of(request_ids, params, outputs, eos) -> SamplingBatch:
    return SamplingBatch(
        request_ids=request_ids,
        params=params,
        temperature=torch.tensor([p.temperature for p in params]),
        all_greedy=all(p.greedy for p in params),
        generators=[None] * len(params),
        prompt_token_ids=[[1]] * len(params),
        output_token_ids=outputs,
        eos_token_id=eos,
    )


def wait_ready(sampler, request_id):
    wait_until(lambda: sampler.is_ready(request_id), interval=0.01)


def compile_workers() -> set[int]:
    """The worker processes of this process (compilations running or idle), by process id."""
    found = set()
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):  # gone, or a zombie nobody reaped yet
            if workers.__name__ in child.cmdline():
                found.add(child.pid)
    return found


def allowed_ids(sampler, tokenizer, params, output, vocab=512) -> set[int]:
    batch = batch_of(["r"], [params], [output], tokenizer.eos_token_id)
    return set(sampler.constrain(torch.zeros(1, vocab), batch)[0].isfinite().nonzero().flatten().tolist())


def test_masks_follow_the_output_and_replay_when_it_changes(tokenizer):
    sampler = OutlinesSampler()
    params = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    sampler.add_request("r", params, tokenizer)
    wait_ready(sampler, "r")
    vocab = token_bytes(tokenizer.backend)
    eos = tokenizer.eos_token_id
    y, n, es = (tokenizer.token_to_id(t) for t in ("y", "n", "es"))

    def continuing(text: bytes) -> set[int]:
        return {i for i, b in vocab.items() if text.startswith(b)}

    assert allowed_ids(sampler, tokenizer, params, []) == continuing(b"yes") | continuing(b"no")
    assert allowed_ids(sampler, tokenizer, params, [y]) == continuing(b"es")
    # The output changed under the sampler (preemption, recompute): it replays from the start.
    assert allowed_ids(sampler, tokenizer, params, [n]) == continuing(b"o")
    assert allowed_ids(sampler, tokenizer, params, [y, es]) == {eos}  # accepting: only EOS
    assert allowed_ids(sampler, tokenizer, params, [y, es, eos]) == {eos}  # after EOS (ignore_eos): EOS again
    assert allowed_ids(sampler, tokenizer, params, [n, tokenizer.token_to_id("o")], vocab=600) == {eos}
    assert sampler.error("r") is None
    # A token the mask never allowed, forced in: the request can only end, and says why.
    assert allowed_ids(sampler, tokenizer, params, [n, es]) == {eos}
    assert "breaks the constraint" in sampler.error("r")
    sampler.remove_request("r")
    assert sampler.error("r") is None


def test_a_complete_answer_ends_even_before_min_tokens(tokenizer):
    sampler = OutlinesSampler()
    params = SamplingParams(temperature=0.0, min_tokens=10, structured_outputs={"choice": ["no"]})
    sampler.add_request("r", params, tokenizer)
    wait_ready(sampler, "r")
    output = [tokenizer.token_to_id("n"), tokenizer.token_to_id("o")]
    batch = batch_of(["r"], [params], [output], tokenizer.eos_token_id)
    # min_tokens bans EOS, the constraint allows nothing else: EOS wins rather than an arbitrary token.
    assert sampler.sample(torch.randn(1, 512), batch).token_ids.tolist() == [tokenizer.eos_token_id]


def test_whitespace_pattern_option(tokenizer):
    sampler = OutlinesSampler(OutlinesOptions(whitespace_pattern=""))
    params = SamplingParams(temperature=1.0, structured_outputs={"json": SCHEMAS["enums"]})
    sampler.add_request("r", params, tokenizer)
    wait_ready(sampler, "r")
    output: list[int] = []
    generator = torch.Generator().manual_seed(0)
    while tokenizer.eos_token_id not in output:
        batch = batch_of(["r"], [params], [output], tokenizer.eos_token_id)
        output += sampler.sample(torch.randn(1, 512, generator=generator), batch).token_ids.tolist()
    text = tokenizer.decode(output)
    jsonschema.validate(json.loads(text), SCHEMAS["enums"])
    assert " " not in text


def test_compiles_in_the_background_once_per_constraint(tokenizer):
    sampler = OutlinesSampler()
    json_object = SamplingParams(structured_outputs={"json_object": True})
    sampler.add_request("a", json_object, tokenizer)
    sampler.add_request("plain", SamplingParams(), tokenizer)
    assert not sampler.is_ready("a")  # ~0.2 s of compiling
    assert sampler.is_ready("plain")
    wait_ready(sampler, "a")
    sampler.add_request("b", json_object, tokenizer)
    assert sampler.is_ready("b")  # the LRU already holds it


def test_compile_failure_is_ready_and_fails_that_request_alone(tokenizer):
    sampler = OutlinesSampler()
    params = SamplingParams(structured_outputs={"json": {"type": "string", "pattern": "a(?=b)"}})
    sampler.add_request("r", params, tokenizer)
    wait_ready(sampler, "r")
    batch = batch_of(["ok", "r"], [SamplingParams(), params], [[], []], tokenizer.eos_token_id)
    with pytest.raises(RequestError) as failed:
        sampler.constrain(torch.zeros(2, 512), batch)
    assert list(failed.value.errors) == ["r"] and "failed to compile" in str(failed.value.errors["r"])


def test_a_compile_past_its_time_limit_is_killed_and_one_nobody_awaits_is_cancelled(tokenizer):
    sampler = OutlinesSampler(OutlinesOptions(compile_workers=1, compile_timeout=0.5))
    slow = SamplingParams(structured_outputs={"regex": "(a|b)*a(a|b){24}"})  # minutes, gigabytes if let run
    sampler.add_request("slow", slow, tokenizer)
    wait_ready(sampler, "slow")
    with pytest.raises(RequestError, match="longer than 0.5 s to compile"):
        sampler.constrain(torch.zeros(1, 512), batch_of(["slow"], [slow], [[]], tokenizer.eos_token_id))
    # An aborted request's compilation stops at once (its time limit is an hour away): its worker is killed, and
    # the one worker's place is free for the next constraint.
    sampler = OutlinesSampler(OutlinesOptions(compile_workers=1, compile_timeout=3600))
    idle = compile_workers()
    sampler.add_request("aborted", SamplingParams(structured_outputs={"regex": "(a|b)*a(a|b){25}"}), tokenizer)
    compiling = wait_until(lambda: compile_workers() - idle)
    sampler.remove_request("aborted")
    wait_until(lambda: not compile_workers() & compiling)
    sampler.add_request("next", SamplingParams(structured_outputs={"choice": ["yes", "no"]}), tokenizer)
    wait_ready(sampler, "next")


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        ({"regex": "a{1000}"}, "a repetition of up to 1000"),
        ({"json": {"type": "string", "maxLength": 100000}}, "a repetition of up to 100000"),
        ({"regex": "a" * 40000}, "its regex has 40000 characters"),
        ({"json": {"type": "integer", "maximum": float("inf")}}, "bounds must be finite"),
        ({"json": {"const": float("nan")}}, "unsupported JSON schema"),
    ],
)
def test_oversized_or_unbounded_constraints_are_refused_up_front(tokenizer, constraint, message):
    with pytest.raises(ValueError, match=message):
        OutlinesSampler().add_request("r", SamplingParams(structured_outputs=constraint), tokenizer)


def test_a_schema_nested_too_deep_is_refused_before_it_is_walked(tokenizer):
    deep: dict = {"type": "string"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="nested"):
        OutlinesSampler().add_request("r", SamplingParams(structured_outputs={"json": deep}), tokenizer)


def test_only_constrained_rows_are_masked(tokenizer):
    sampler = OutlinesSampler()
    constrained = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    sampler.add_request("c", constrained, tokenizer)
    wait_ready(sampler, "c")
    logits = torch.randn(2, 600)  # the model's vocabulary may be padded past the tokenizer's
    batch = batch_of(["u", "c"], [SamplingParams(), constrained], [[], []], tokenizer.eos_token_id)
    out = sampler.constrain(logits, batch)
    assert torch.equal(out[0], logits[0])
    digits = {i for i, b in token_bytes(tokenizer.backend).items() if b.isdigit()}
    assert set(out[1].isfinite().nonzero().flatten().tolist()) == digits


def test_a_constrained_request_the_sampler_never_saw_is_an_error(tokenizer):
    params = SamplingParams(structured_outputs={"regex": "a"})
    with pytest.raises(RuntimeError, match="never passed to add_request"):
        OutlinesSampler().constrain(torch.zeros(1, 512), batch_of(["r"], [params], [[]], 2))


# --- vocabulary and regexes --------------------------------------------------------


def test_vocabulary_bytes_round_trip(tokenizer):
    mapping = token_bytes(tokenizer.backend)
    specials = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
    assert set(mapping) == set(range(tokenizer.vocab_size)) - specials
    assert tokenizer.eos_token_id in specials
    assert {bytes([b]) for b in range(256)} <= set(mapping.values())  # byte-level: every byte is spellable
    checked = 0
    for token_id, data in mapping.items():
        try:
            text = data.decode()
        except UnicodeDecodeError:
            continue
        assert tokenizer.decode([token_id]) == text, token_id
        checked += 1
    assert checked > len(mapping) // 2


def test_vocabulary_bytes_of_sentencepiece_tokenizers():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x0A>": 3, "<0xE2>": 4, "▁": 5, "▁the": 6, "é": 7, "▁▁": 8}
    for decoder in (
        decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        ),
        decoders.Metaspace(replacement="▁"),
    ):
        tok = HFTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
        tok.add_special_tokens(["<unk>", "<s>", "</s>"])
        tok.add_tokens([AddedToken("<tool>", special=False)])
        tok.decoder = decoder
        assert token_bytes(tok) == {
            3: b"\n",
            4: b"\xe2",
            5: b" ",
            6: b" the",
            7: "é".encode(),
            8: b"  ",
            tok.token_to_id("<tool>"): b"<tool>",
        }


def test_bounded_numbers_match_exactly_their_range():
    for lo, hi in [(0, 9), (-5, 120), (-1000, -10), (13, 1234), (None, 5), (-20, None), (7, 7)]:
        for kind in ("integer", "number"):
            schema = {
                "type": kind,
                **({"minimum": lo} if lo is not None else {}),
                **({"maximum": hi} if hi is not None else {}),
            }
            pattern = re.compile(bounded_number_regex(schema))
            for text in [str(i) for i in range(-1300, 1300)] + [
                f"{i}.{f}" for i in range(-130, 130) for f in ("0", "25")
            ]:
                value = float(text)
                inside = (lo is None or value >= lo) and (hi is None or value <= hi)
                expected = inside and (kind == "number" or "." not in text) and not text.startswith("-0")
                if not text.startswith("-0"):
                    assert bool(pattern.fullmatch(text)) == expected, (schema, text)
    # Exclusive and fractional bounds narrow to the whole numbers inside, so every output still validates.
    pattern = re.compile(bounded_number_regex({"type": "number", "exclusiveMinimum": 0.5, "maximum": 2.5}))
    assert [t for t in ("0.75", "1", "1.5", "2", "2.0", "2.25", "3") if pattern.fullmatch(t)] == [
        "1",
        "1.5",
        "2",
        "2.0",
    ]
    with pytest.raises(ValueError, match="no whole number"):
        bounded_number_regex({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4})
    assert '"FWBOUNDED' not in schema_regex(SCHEMAS["bounds"])


def test_choices_are_escaped_literally():
    choices = ["a.b", "(x)", "1+1", "$5 [new]", "é-è"]
    pattern = choice_regex(choices)
    check_regex(pattern)
    assert [c for c in [*choices, "aXb", "x", "11"] if re.fullmatch(pattern, c)] == choices
