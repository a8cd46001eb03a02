"""`fw serve` as a drop-in for `vllm serve`: its flags, vLLM's request extras, batched completions, /tokenize."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from conftest import fw_serve

PROMPTS = ["Hello world", "The quick brown fox", "Once upon a time", "import torch"]


@pytest.fixture(scope="module")
def vserver(tiny):
    """The tiny model served the vLLM way: positional MODEL, vLLM's flags."""
    with fw_serve(tiny, "--served-model-name", "tiny", "--num-kv-blocks", "256", "--max-model-len", "128",
                  "--max-num-seqs", "64", "--enforce-eager", "--max-logprobs", "20") as (base, proc):
        yield base, proc


@pytest.fixture(scope="module")
def client(vserver):
    return openai.OpenAI(base_url=f"{vserver[0]}/v1", api_key="unused")


def post(base: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=120, **kw)


def greedy(client, prompt: str, max_tokens: int = 8) -> str:
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text


def single_token_ids(base: str, *texts: str) -> list[int]:
    ids = [post(base, "/tokenize", {"prompt": t}).json()["tokens"] for t in texts]
    assert all(len(i) == 1 for i in ids), ids
    return [i[0] for i in ids]


def test_echo_with_logprobs_returns_the_prompt_and_its_logprobs(vserver, client):
    base, _ = vserver
    allowed = single_token_ids(base, "a", "b", "c")  # whole characters, so the tokens spell the text exactly
    comp = client.completions.create(model="tiny", prompt="Hello world", max_tokens=5, temperature=0, echo=True,
                                     logprobs=1, extra_body={"allowed_token_ids": allowed})
    choice, usage = comp.choices[0], comp.usage
    lp = choice.logprobs
    assert choice.text.startswith("Hello world") and set(choice.text[len("Hello world"):]) <= set("abc")
    assert len(lp.tokens) == usage.prompt_tokens + usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first prompt token
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.text_offset[usage.prompt_tokens] == len("Hello world")
    # The prompt part equals what prompt_logprobs reports for the same prompt.
    raw = post(base, "/v1/completions", {"prompt": "Hello world", "max_tokens": 1, "prompt_logprobs": 0}).json()
    prompt_lps = raw["choices"][0]["prompt_logprobs"]
    ids = post(base, "/tokenize", {"prompt": "Hello world"}).json()["tokens"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(ids)
    for i in range(1, len(ids)):
        assert prompt_lps[i][str(ids[i])]["logprob"] == pytest.approx(lp.token_logprobs[i], abs=1e-4)


def test_two_prompts_stream_with_openai_indexes(client):
    expected = [greedy(client, p) for p in PROMPTS[:2]]
    texts: dict[int, str] = {}
    finished = set()
    for chunk in client.completions.create(model="tiny", prompt=PROMPTS[:2], n=2, max_tokens=8, temperature=0,
                                           stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2, 3}  # prompt_index * n + sequence index
    assert [texts[i] for i in range(4)] == [expected[0], expected[0], expected[1], expected[1]]


def test_a_list_of_16_prompts_answers_each_in_order(vserver, client):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(16)]
    expected = [greedy(client, p) for p in prompts]
    resp = post(vserver[0], "/v1/completions", {"prompt": prompts, "max_tokens": 8, "temperature": 0})
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert [c["index"] for c in choices] == list(range(16))
    assert [c["text"] for c in choices] == expected


def test_unknown_fields_are_ignored_with_a_warning(vserver):
    base, proc = vserver
    resp = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                              "frobnicate": True, "stream_options": {"flux": 1}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == "tiny"  # model omitted: the served one
    log = proc.log()
    assert "ignored: ['frobnicate']" in log and "ignored: ['flux']" in log
    bad = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"  # a wrong type still is a 400


def test_per_request_and_access_log_lines(vserver):
    base, proc = vserver
    post(base, "/v1/completions", {"prompt": "log me", "max_tokens": 2, "request_id": "log-me-1"})
    log = proc.log()
    assert re.search(r"Received request cmpl-log-me-1: prompt tokens: \d+, params: .*max_tokens=2", log)
    assert '"POST /v1/completions HTTP/1.1" 200' in log


def test_tools_on_a_server_without_tool_flags(vserver):
    """tool_choice "none" renders the tools; "auto" (or none given) needs --enable-auto-tool-choice; "required"
    with the default template, which ignores tools, is a clear 400 (fw.tool_calls; tests/test_tools.py)."""
    base, _ = vserver
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "tools": tools}
    ok = post(base, "/v1/chat/completions", {**chat, "tool_choice": "none"})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
    for choice, says in (("auto", "--enable-auto-tool-choice"), (None, "--enable-auto-tool-choice"),
                         ("required", "ignores tools")):
        body = {**chat, "tool_choice": choice} if choice else chat  # absent means auto
        resp = post(base, "/v1/chat/completions", body)
        assert resp.status_code == 400 and says in resp.json()["error"]["message"], choice


def test_tokenize_and_detokenize_round_trip(vserver):
    base, _ = vserver
    tok = post(base, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == 128
    assert post(base, "/detokenize", {"tokens": tok["tokens"]}).json() == {"prompt": "Hello world"}
    assert post(base, "/tokenize", {"prompt": "Hi"}).json()["token_strs"] is None
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    chat = post(base, "/tokenize", {"messages": messages}).json()
    text = post(base, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # continue_final_message leaves the final message open for the model to continue.
    prefill = [*messages, {"role": "assistant", "content": "The answer is"}]
    open_ = post(base, "/tokenize", {"messages": prefill, "continue_final_message": True}).json()
    assert post(base, "/detokenize", {"tokens": open_["tokens"]}).json()["prompt"].endswith("assistant\nThe answer is")
    assert post(base, "/detokenize", {"tokens": [10**6]}).status_code == 400
    assert post(base, "/tokenize", {"prompt": "x", "model": "gpt-9"}).status_code == 404


def test_vllm_extras_take_effect(vserver, client):
    base, _ = vserver
    a, b = single_token_ids(base, "a", "b")
    only_b = post(base, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "allowed_token_ids": [a, b],
                                            "bad_words": ["a"]}).json()
    assert only_b["choices"][0]["text"] == "bbbb"
    choice = client.completions.create(model="tiny", prompt="Answer:", max_tokens=8,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")
    digits = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "A number?"}],
                                            max_tokens=8, extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", digits.choices[0].message.content)
    by_body = post(base, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "request_id": "r-1"})
    assert by_body.json()["id"] == "cmpl-r-1" and by_body.headers["x-request-id"] == "r-1"
    by_header = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                                    "request_id": "r-2"}, headers={"X-Request-Id": "r-3"})
    assert by_header.json()["id"] == "chatcmpl-r-3"  # the header wins, as in vLLM
    chat_lps = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                                   "prompt_logprobs": 1}).json()
    assert chat_lps["prompt_logprobs"][0] is None and len(chat_lps["prompt_logprobs"]) == chat_lps["usage"]["prompt_tokens"]
    truncated = post(base, "/v1/completions", {"prompt": list(range(10, 30)), "max_tokens": 1,
                                               "truncate_prompt_tokens": 5, "echo": True}).json()
    assert truncated["usage"]["prompt_tokens"] == 5
    assert truncated["choices"][0]["text"].startswith(post(base, "/detokenize", {"tokens": list(range(25, 30))}).json()["prompt"])
    ids = post(base, "/tokenize", {"prompt": "Hello world"}).json()["tokens"]
    echoed_ids = post(base, "/v1/completions", {"prompt": ids, "max_tokens": 1, "echo": True}).json()
    assert echoed_ids["choices"][0]["text"].startswith("Hello world")  # token-id prompts echo as their text
    chunks = list(client.completions.create(model="tiny", prompt="Hi", max_tokens=4, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks) and chunks[-1].choices == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "Hi", "suffix": "!"}, "suffix"),
        ({"prompt": "Hi", "best_of": 2}, "best_of"),
        ({"prompt": "Hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "Hi", "structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs"),
        ({"prompt": "Hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"prompt": "Hi", "model": "gpt-9"}, "model"),
    ],
)
def test_refused_completion_requests(vserver, body, param):
    resp = post(vserver[0], "/v1/completions", body)
    assert resp.status_code in (400, 404), resp.text
    assert resp.json()["error"]["param"] == param


def test_a_request_chat_template_is_refused_by_default(vserver):
    base, _ = vserver
    for template in ("{{ messages[0].content }}", "/etc/passwd", "/bin/ls"):
        for path in ("/v1/chat/completions", "/tokenize"):
            resp = post(base, path, {"messages": [{"role": "user", "content": "Hi"}], "chat_template": template})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template", resp.text
            assert "--allow-request-chat-template" in resp.json()["error"]["message"]


def test_best_of_equal_to_n_and_chat_top_logprobs_limit(vserver):
    base, _ = vserver
    ok = post(base, "/v1/completions", {"prompt": "Hi", "best_of": 2, "n": 2, "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    chat = {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 21}
    assert post(base, "/v1/chat/completions", chat).json()["error"]["param"] == "top_logprobs"


# --- the command line -----------------------------------------------------------


def test_serve_help_lists_the_vllm_flags(fw_cli):
    result = fw_cli("serve", "--help")
    assert result.returncode == 0 and "fw serve [OPTIONS] [MODEL]" in result.stdout
    for flag in ("--disable-log-requests", "--uvicorn-log-level", "--max-logprobs", "--generation-config",
                 "--enforce-eager", "--trust-remote-code"):
        assert flag in result.stdout, flag


def test_trust_remote_code_is_refused(fw_cli, tiny):
    result = fw_cli("serve", tiny, "--trust-remote-code")
    assert result.returncode == 2 and "runs no code from model repositories" in result.stderr


def test_positional_model_and_a_different_model_flag_conflict(fw_cli, tiny):
    result = fw_cli("serve", tiny, "--model", "/elsewhere")
    assert result.returncode == 2 and "differ" in result.stderr


def test_config_show_reflects_the_new_settings(fw_cli, tmp_path):
    (tmp_path / "generation_config.json").write_text("{}")
    result = fw_cli("config", "show", "--max-logprobs", "5", "--uvicorn-log-level", "debug", "--disable-log-requests",
                    "--generation-config", str(tmp_path), "--enforce-eager")
    assert result.returncode == 0, result.stderr
    for line in ("max_logprobs: 5  # --max-logprobs", 'uvicorn_log_level: "debug"  # --uvicorn-log-level',
                 "disable_log_requests: true  # --disable-log-requests", "enforce_eager: true  # --enforce-eager",
                 f'generation_config: "{tmp_path}"  # --generation-config'):
        assert line in result.stdout, line
    assert fw_cli("config", "show", "--uvicorn-log-level", "loud").returncode == 2
    missing = fw_cli("config", "show", "--generation-config", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "generation_config.json" in missing.stderr


def _generation_config(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3, "top_k": 50}))
    return folder


def test_generation_config_gives_the_server_its_defaults(tiny, tmp_path):
    folder = _generation_config(tmp_path / "gen")
    with fw_serve(tiny, "--served-model-name", "tiny", "--num-kv-blocks", "64", "--max-model-len", "128",
                  "--generation-config", str(folder), "--disable-log-requests", "--uvicorn-log-level", "warning") as (base, proc):
        first, second = (post(base, "/v1/completions", {"prompt": "Once upon"}).json() for _ in range(2))
        assert first["usage"]["completion_tokens"] == 3 and first["choices"][0]["text"] == second["choices"][0]["text"]
        assert post(base, "/v1/completions", {"prompt": "Once upon", "max_tokens": 5}).json()["usage"]["completion_tokens"] == 5
        log = proc.log()
        assert "{'temperature': 0.0, 'max_tokens': 3}" in log  # top_k 50 is transformers' default: vLLM drops it too
        assert "Received request" not in log and "POST /v1/completions" not in log


def test_offline_llm_takes_the_generation_config_too(tiny, tmp_path):
    from fw import LLM

    llm = LLM(tiny, num_kv_blocks=64, max_model_len=128, generation_config=str(_generation_config(tmp_path / "gen")))
    try:
        assert llm.get_default_sampling_params().max_tokens == 3
        assert len(llm.generate("Once upon", use_tqdm=False)[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()
