import json

import pytest

from fw import LLM, SamplingParams
from fw.testing.conformance import HooksConformance
from fw.testing.models import make_tiny_model


class TestStepLogConformance(HooksConformance):
    plugin = "steplog"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("steplog") / "llama"))


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_engines_log_to_their_own_files(model, tmp_path):
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    a = LLM(model, steplog=str(first), num_kv_blocks=16, max_model_len=128, device="cpu")
    b = LLM(model, steplog=str(second), num_kv_blocks=16, max_model_len=128, device="cpu")
    a.generate(["Hello there"], params, use_tqdm=False)
    b.generate(["Hello there", "The quick brown fox"], params, use_tqdm=False)
    a.shutdown()
    b.shutdown()
    for path, requests in ((first, 1), (second, 2)):
        steps = lines(path)
        assert [s["step"] for s in steps] == [0, 1, 2]
        assert steps[0]["num_decode_tokens"] == 0 and steps[0]["num_prefill_tokens"] > 0
        assert [s["num_decode_tokens"] for s in steps[1:]] == [requests, requests]
        assert all(s["num_scheduled"] == requests and s["forward_seconds"] >= 0 for s in steps)


def test_without_a_path_it_writes_nothing(model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    llm = LLM(model, num_kv_blocks=16, max_model_len=128, device="cpu")
    llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()
    assert not list(tmp_path.iterdir())
