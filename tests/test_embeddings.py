"""Embeddings (issue 34): pooling requests through the engine's scheduler, ``LLM.embed`` / ``LLM.encode``, and
``/v1/embeddings`` under the official openai client, each checked against transformers' hidden states."""

from __future__ import annotations

import base64
import json
import os
import shutil
import struct
import threading
from pathlib import Path

import httpx
import pytest
import torch

from conftest import fw_serve, make_site

TEXTS = [
    "The capital of France is Paris.",
    "Embeddings map text to vectors.",
    "A quick brown fox jumps over the lazy dog, again and again, until the dog finally wakes up and leaves.",
    "42",
]
TINY = {"num_kv_blocks": 64, "max_model_len": 256, "device": "cpu"}
# Chunked prefill in pieces of 8 tokens: mean pooling must add up a prompt across steps.
CHUNKED = {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8}


def _pool(hidden: torch.Tensor, kind: str) -> torch.Tensor:
    return {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[kind]


def _cosine(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.as_tensor(a), torch.as_tensor(b), dim=0))


@pytest.fixture(scope="module")
def tiny_reference(tiny):
    """The tiny model's final hidden states (transformers' last_hidden_state), per token-id list."""
    import transformers

    model = transformers.AutoModel.from_pretrained(tiny, dtype=torch.float32).eval()

    def hidden(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).last_hidden_state[0]

    return hidden


def _llm(path, **kwargs):
    from fw import LLM

    return LLM(str(path), **{**TINY, **kwargs})


# --- the engine and LLM.embed on a tiny random-weight model ------------------------------------------------------


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_each_pooling_type_matches_transformers(tiny, tiny_reference, kind):
    from fw import PoolingParams

    llm = _llm(tiny, pooling=kind, **CHUNKED)
    try:
        outputs = llm.embed(TEXTS, use_tqdm=False)
        raw = llm.encode(TEXTS, PoolingParams(normalize=False), use_tqdm=False)
    finally:
        llm.shutdown()
    assert max(len(o.prompt_token_ids) for o in outputs) > 16  # a prompt that took several steps
    for out, unnormalized in zip(outputs, raw, strict=True):
        reference = _pool(tiny_reference(out.prompt_token_ids), kind)
        assert _cosine(out.outputs.embedding, reference) >= 0.9999
        assert torch.allclose(unnormalized.outputs.data, reference, atol=1e-4)
        assert torch.linalg.norm(torch.tensor(out.outputs.embedding)) == pytest.approx(1.0, abs=1e-5)


def test_pooling_skips_the_prefix_cache_unless_it_pools_the_last_token(tiny, tiny_reference):
    """A prefix-cache hit skips computing positions that mean and CLS pooling need: such requests compute their
    whole prompt, as vLLM's do; last-token pooling takes the hit and gives the same vector."""
    from fw import PoolingParams, SamplingParams

    prompt = TEXTS[2] * 2
    for kind in ("mean", "cls", "last"):
        llm = _llm(tiny, pooling=kind)
        try:
            llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)  # fills the prefix cache
            (out,) = llm.encode([prompt], PoolingParams(normalize=False), use_tqdm=False)
        finally:
            llm.shutdown()
        assert (out.num_cached_tokens > 0) == (kind == "last")
        assert torch.allclose(out.outputs.data, _pool(tiny_reference(out.prompt_token_ids), kind), atol=1e-4)


@pytest.fixture
def steps():
    """The StepStats of every engine step while the test runs, through a fw_step_stats hook."""
    from fw import hookimpl, plugins

    class Recorder:
        def __init__(self):
            self.stats = []

        @hookimpl
        def fw_step_stats(self, stats, engine):
            self.stats.append(stats)

    recorder = Recorder()
    manager = plugins.get_plugin_manager()
    manager.register(recorder)
    yield recorder.stats
    manager.unregister(recorder)


def test_a_batch_of_64_runs_as_one_step(tiny, steps):
    """64 inputs are admitted together and the scheduler runs them in one engine step, not one after another."""
    llm = _llm(tiny, max_num_seqs=64, max_num_batched_tokens=1024)
    try:
        outputs = llm.embed([f"input number {i}" for i in range(64)], use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(outputs) == 64 and all(o.finished for o in outputs)
    assert [s.num_scheduled for s in steps] == [64]


def test_generation_and_pooling_share_steps(tiny, tiny_reference, steps):
    """A pooling request admitted while generation runs joins the running batch; both come out right."""
    from fw import PoolingParams, SamplingParams

    llm = _llm(tiny)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    try:
        alone = llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0].token_ids
        first = len(steps)
        engine.add_request("Hello there", params, "gen")
        engine.step()
        engine.add_request(TEXTS[0], PoolingParams(), "pool")
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
    finally:
        llm.shutdown()
    assert steps[first + 1].num_scheduled == 2  # the generation's second step computed the pooled prompt too
    assert done["gen"].outputs[0].token_ids == alone
    reference = _pool(tiny_reference(done["pool"].prompt_token_ids), "last")
    assert _cosine(done["pool"].outputs.data, reference) >= 0.9999


def test_the_models_sentence_transformers_pooling_config(tiny, tiny_reference, tmp_path):
    """modules.json naming a mean Pooling module and no Normalize: mean pooling, unnormalized; --pooling cls
    overrides the type only."""
    model = Path(shutil.copytree(tiny, tmp_path / "st"))
    (model / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}))
    for configured, kind in (("auto", "mean"), ("cls", "cls")):
        llm = _llm(model, pooling=configured)
        try:
            (out,) = llm.encode([TEXTS[1]], use_tqdm=False)
        finally:
            llm.shutdown()
        assert torch.allclose(out.outputs.data, _pool(tiny_reference(out.prompt_token_ids), kind), atol=1e-4)


def test_dimensions_only_on_a_matryoshka_model(checkpoint, tiny):
    from fw import PoolingParams

    llm = _llm(checkpoint("LlamaForCausalLM", is_matryoshka=True))
    try:
        (full,) = llm.encode([TEXTS[0]], PoolingParams(normalize=False), use_tqdm=False)
        (short,) = llm.encode([TEXTS[0]], PoolingParams(dimensions=8), use_tqdm=False)
    finally:
        llm.shutdown()
    assert torch.allclose(short.outputs.data, torch.nn.functional.normalize(full.outputs.data[:8], dim=0), atol=1e-6)
    llm = _llm(tiny)
    try:
        with pytest.raises(ValueError, match="Matryoshka"):
            llm.embed([TEXTS[0]], pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    finally:
        llm.shutdown()


def test_a_model_that_cannot_pool_refuses_clearly(tiny, monkeypatch):
    from fw import PoolingParams
    from fw.models.llama import LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "supports_pooling", False)
    llm = _llm(tiny)
    try:
        assert llm.llm_engine.view.supported_tasks == ("generate",)
        with pytest.raises(ValueError, match="cannot pool"):
            llm.encode([TEXTS[0]], PoolingParams(), use_tqdm=False)
    finally:
        llm.shutdown()


# --- /v1/embeddings on the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) -----------------------------


@pytest.fixture(scope="module")
def default_server():
    with fw_serve("--max-model-len", "512", "--max-num-seqs", "16") as (base, _proc):
        yield base


@pytest.fixture(scope="module")
def gguf_reference():
    """The default model's final hidden states from transformers, independent of fw's forward: transformers'
    GGUF reader dequantizes the checkpoint into a float32 LlamaForCausalLM."""
    pytest.importorskip("gguf")
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from fw import plugins

    path = plugins.get_plugin_manager().hook.fw_default_model()
    settings = load_gguf_checkpoint(path)["config"]
    config = transformers.LlamaConfig(**{k: v for k, v in settings.items() if k != "model_type"})
    model = transformers.LlamaForCausalLM(config).float().eval()
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict({name: torch.as_tensor(t) for name, t in tensors.items()}, strict=False)

    def hidden(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]

    return hidden


def _client(base):
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused")


def _model(base) -> str:
    return httpx.get(f"{base}/v1/models").json()["data"][0]["id"]


def _token_ids(base, text: str) -> list[int]:
    return httpx.post(f"{base}/tokenize", json={"prompt": text}).json()["tokens"]


def _embed(base, **body) -> httpx.Response:
    return httpx.post(f"{base}/v1/embeddings", json={"model": _model(base), **body}, timeout=120)


def test_openai_client_matches_a_transformers_pooling_of_the_default_model(default_server, gguf_reference):
    """vLLM's default for a decoder: the last token's final hidden state, L2-normalized."""
    client = _client(default_server)
    result = client.embeddings.create(model=_model(default_server), input=TEXTS)  # the client asks for base64
    ids = [_token_ids(default_server, text) for text in TEXTS]
    assert [d.index for d in result.data] == list(range(len(TEXTS)))
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(map(len, ids))
    for data, token_ids in zip(result.data, ids, strict=True):
        reference = torch.nn.functional.normalize(gguf_reference(token_ids)[-1], dim=0)
        assert len(data.embedding) == reference.numel()
        assert _cosine(data.embedding, reference) >= 0.9999


def test_float_base64_and_token_id_inputs_agree(default_server):
    floats = _embed(default_server, input=TEXTS[:2], encoding_format="float").json()
    packed = _embed(default_server, input=TEXTS[:2], encoding_format="base64").json()
    ids = [_token_ids(default_server, text) for text in TEXTS[:2]]
    one_list = _embed(default_server, input=ids[0], encoding_format="float").json()
    two_lists = _embed(default_server, input=ids, encoding_format="float").json()
    vectors = [d["embedding"] for d in floats["data"]]
    for data, vector in zip(packed["data"], vectors, strict=True):
        raw = base64.b64decode(data["embedding"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == vector  # little-endian float32, as OpenAI's
    assert torch.allclose(torch.tensor(one_list["data"][0]["embedding"]), torch.tensor(vectors[0]), atol=1e-5)
    for data, vector in zip(two_lists["data"], vectors, strict=True):
        assert torch.allclose(torch.tensor(data["embedding"]), torch.tensor(vector), atol=1e-5)
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"


def test_models_say_what_the_model_serves(default_server):
    (card,) = httpx.get(f"{default_server}/v1/models").json()["data"]
    assert card["object"] == "model" and card["supported_tasks"] == ["generate", "embed"]


@pytest.mark.parametrize(("body", "status", "says"), [
    ({"input": ""}, 400, "must not be empty"),
    ({"input": []}, 400, "must not be empty"),
    ({"input": [[]]}, 400, "must not be empty"),
    ({"input": ["fine", ""]}, 400, "empty"),
    ({"input": [5] * 600}, 400, "max_model_len"),
    ({"input": [10**6]}, 400, "token ids"),
    ({"input": ["x"] * 65}, 400, "at most 64"),
    ({"input": "x", "encoding_format": "hex"}, 400, "encoding_format"),
    ({"input": "x", "dimensions": 0}, 400, "dimensions"),
    ({"input": "x", "dimensions": 64}, 400, "Matryoshka"),
    ({"input": "x", "model": "no-such-model"}, 404, "does not exist"),
])
def test_bad_input_gets_a_clear_4xx(default_server, body, status, says):
    response = httpx.post(f"{default_server}/v1/embeddings", json={"model": _model(default_server), **body})
    assert response.status_code == status, response.text
    assert says in response.json()["error"]["message"]


def test_embeddings_and_generation_on_one_server(default_server):
    """A chat completion and embeddings requests at the same time: each answers as it does alone."""
    client = _client(default_server)
    model = _model(default_server)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    alone = _embed(default_server, input=TEXTS[0], encoding_format="float").json()["data"][0]["embedding"]
    results = {}

    def chat():
        results["chat"] = client.chat.completions.create(model=model, messages=question, max_tokens=24,
                                                         temperature=0)

    thread = threading.Thread(target=chat)
    thread.start()
    embedded = [_embed(default_server, input=TEXTS[0], encoding_format="float") for _ in range(3)]
    thread.join()
    assert "Paris" in results["chat"].choices[0].message.content
    for response in embedded:
        assert torch.allclose(torch.tensor(response.json()["data"][0]["embedding"]), torch.tensor(alone), atol=1e-5)


# --- a server whose model cannot pool ---------------------------------------------------------------------------

NO_POOL = """
from fw.interfaces.base import frozen
from fw.interfaces.model import ModelCapabilities
from fw.interfaces.spec import PluginSpec
from fw.models.llama import LlamaForCausalLM


class NoPoolLlama(LlamaForCausalLM):
    supports_pooling = False


SPEC = PluginSpec(name="nopool", kind="models", impl="nopool:NoPoolLlama", api_version=1,
                  capabilities=ModelCapabilities(architectures=frozen("NoPoolLlamaForCausalLM"),
                                                 devices=frozen("cpu", "cuda")))
"""


def test_embeddings_on_a_model_that_cannot_pool_is_a_400(tiny, tmp_path):
    site = make_site(tmp_path / "site", "fw-model-nopool", {"fw.models": {"nopool": "nopool:SPEC"}},
                     {"nopool": NO_POOL})
    model = Path(shutil.copytree(tiny, tmp_path / "nopool"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["NoPoolLlamaForCausalLM"]}))
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    with fw_serve("--model", str(model), "--num-kv-blocks", "32", env={"PYTHONPATH": path}) as (base, _proc):
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["supported_tasks"] == ["generate"]
        response = _embed(base, input="hello")
        completion = httpx.post(f"{base}/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert response.status_code == 400
    assert "does not support the Embeddings API" in response.json()["error"]["message"]
    assert completion.status_code == 200
