"""`fw serve`: the OpenAI API under real clients, load, cancellation, bad input, auth, metrics, shutdown."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

from conftest import fw_serve, metric_values


@pytest.fixture(scope="module")
def server(tiny):
    with fw_serve("--model", tiny, "--served-model-name", "tiny", "--num-kv-blocks", "256",
                  "--max-model-len", "128", "--max-num-seqs", "64") as (base, _proc):
        yield base


def chat_body(content: str, **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **kw}


async def stream_chat(client: httpx.AsyncClient, base: str, body: dict, stop_after: int | None = None):
    """Stream one chat completion; returns (text, usage) or None when cancelled after `stop_after` chunks."""
    text, usage, chunks = "", None, 0
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            chunks += 1
            if data.get("usage"):
                usage = data["usage"]
            for choice in data["choices"]:
                text += choice["delta"].get("content", "")
            if stop_after is not None and chunks >= stop_after:
                return None  # leaving the block closes the connection mid-stream
    return text, usage


def test_openai_client_endpoints(server):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    comp = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    assert comp.choices[0].finish_reason in ("length", "stop") and comp.usage.completion_tokens <= 5
    assert len(comp.choices[0].logprobs.token_logprobs) == comp.usage.completion_tokens
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=3)
    assert chat.choices[0].message.role == "assistant"
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_64_concurrent_streams_then_half_cancelled(server):
    prompts = [f"Request number {i} says" for i in range(64)]
    greedy = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}
    expected = [
        httpx.post(f"{server}/v1/chat/completions", json=chat_body(p, **{**greedy, "stream": False}),
                   timeout=120).json()
        for p in prompts[:4]
    ]

    async def run(cancel_half: bool):
        async with httpx.AsyncClient(timeout=300) as client:
            tasks = [
                stream_chat(client, server, chat_body(p, **greedy), stop_after=2 if cancel_half and i % 2 else None)
                for i, p in enumerate(prompts)
            ]
            return await asyncio.gather(*tasks)

    results = asyncio.run(run(cancel_half=False))
    for i, (_text, usage) in enumerate(results):
        assert usage["completion_tokens"] == 12, i
        assert usage["prompt_tokens"] > 5
    for i, ref in enumerate(expected):  # nothing mixed: streamed text equals each prompt's own answer
        assert results[i][0] == ref["choices"][0]["message"]["content"]
        assert results[i][1]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    before = metric_values(server)
    results = asyncio.run(run(cancel_half=True))
    assert sum(r is None for r in results) == 32 and all(r[1]["completion_tokens"] == 12 for r in results if r)
    deadline = time.monotonic() + 30
    while True:
        after = metric_values(server)
        if after["fw:num_requests_running"] == 0 and after["fw:kv_cache_usage_perc"] == 0.0:
            break
        assert time.monotonic() < deadline, after
        time.sleep(0.2)
    assert after["fw:num_requests_waiting"] == 0
    assert after["fw:generation_tokens_total"] >= before["fw:generation_tokens_total"] + 32 * 12


BAD_INPUTS = [
    ("malformed json", b"{not json", 400, None),
    ("wrong type", {"model": "tiny", "messages": "hello"}, 400, "messages"),
    ("unknown model", {**chat_body("hi"), "model": "gpt-9"}, 404, "model"),
    ("prompt too long", chat_body("word " * 400), 400, None),
    ("max_tokens beyond context", chat_body("hi", max_tokens=1000), 400, None),
    ("temperature out of range", chat_body("hi", temperature=3.5), 400, "temperature"),
    ("top_p out of range", chat_body("hi", top_p=0), 400, "top_p"),
    ("negative max_tokens", chat_body("hi", max_tokens=-1), 400, "max_tokens"),
    ("empty messages", {"model": "tiny", "messages": []}, 400, "messages"),
    ("bad role", {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ("invalid schema", chat_body("hi", response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
     400, None),
    ("bad logit bias", chat_body("hi", logit_bias={"5": 500}), 400, "logit_bias"),
    # tools without tool_choice mean "auto", which needs --enable-auto-tool-choice (vLLM's rule)
    ("tools without auto tool choice", chat_body("hi", tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "tool_choice"),
]


@pytest.mark.parametrize(("name", "body", "status", "param"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, name, body, status, param):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    resp = httpx.post(f"{server}/v1/chat/completions", timeout=60, **kwargs)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["message"] and error["type"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    ok = httpx.post(f"{server}/v1/chat/completions", json=chat_body("hi", max_tokens=2), timeout=60)
    assert ok.status_code == 200


def test_completion_bad_inputs(server):
    cases = [
        ({"model": "tiny", "prompt": ""}, 400),
        ({"model": "tiny", "prompt": [999999]}, 400),
        ({"model": "tiny", "prompt": "hi", "n": 0}, 400),
        ({"model": "tiny", "prompt": "hi", "logprobs": 21}, 400),  # above --max-logprobs (20)
        ({"model": "tiny", "prompt": "hi", "guided_regex": "(unclosed"}, 400),
    ]
    for body, status in cases:
        resp = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
        assert resp.status_code == status, (body, resp.text)
        assert "message" in resp.json()["error"]


def test_metrics_parse_and_move(server):
    before = metric_values(server)
    httpx.post(f"{server}/v1/completions", json={"model": "tiny", "prompt": "count me", "max_tokens": 3,
                                                 "ignore_eos": True}, timeout=60)
    after = metric_values(server)
    assert after["fw:prompt_tokens_total"] > before["fw:prompt_tokens_total"]
    assert after["fw:generation_tokens_total"] == before["fw:generation_tokens_total"] + 3
    assert after["fw:e2e_request_latency_seconds_count"] == before["fw:e2e_request_latency_seconds_count"] + 1
    assert after["fw:time_to_first_token_seconds_count"] > before["fw:time_to_first_token_seconds_count"]
    assert after["fw:prefix_cache_queries_total"] > before["fw:prefix_cache_queries_total"]
    for name in ("fw:num_requests_running", "fw:num_requests_waiting", "fw:kv_cache_usage_perc",
                 "fw:num_preemptions_total"):
        assert name in after


def test_api_key(tiny):
    with fw_serve("--model", tiny, "--num-kv-blocks", "64", "--max-model-len", "128", "--public-docs",
                  env={"FW_SERVER__API_KEY": "sekret"}) as (base, _):
        assert httpx.get(f"{base}/v1/models").status_code == 401
        wrong = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert wrong.headers["www-authenticate"] == "Bearer"
        assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(f"{base}/v1/models", headers={"Authorization": "bearer sekret"}).status_code == 200
        assert httpx.post(f"{base}/tokenize", json={"prompt": "hi"}).status_code == 401
        assert httpx.post(f"{base}/detokenize", json={"tokens": [1]}, headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(f"{base}/health").status_code == 200
        for path in ("/metrics", "/version"):  # protected unless --public-metrics; /version always
            assert httpx.get(f"{base}{path}").status_code == 401, path
        for path in ("/docs", "/openapi.json", "/redoc"):  # --public-docs
            assert httpx.get(f"{base}{path}").status_code == 200, path


def test_an_empty_api_key_is_an_error(fw_cli, tmp_path):
    empty = tmp_path / "key"
    empty.write_text("\n")
    for args, env in ((["--api-key", ""], {}), ([], {"FW_SERVER__API_KEY": ""}), (["--api-key-file", str(empty)], {})):
        result = fw_cli("config", "show", *args, env=env)
        assert result.returncode == 2 and "empty" in result.stderr, (args, env, result.stderr)


def test_sigterm_drains_answering_503_then_exits_0(tiny):
    """After SIGTERM the in-flight stream finishes; meanwhile new requests get 503 with Retry-After and /health
    turns 503, so a load balancer moves on; then the process exits 0."""
    with fw_serve("--model", tiny, "--served-model-name", "tiny", "--num-kv-blocks", "128",
                  "--max-model-len", "1024") as (base, proc):

        async def scenario():
            async with httpx.AsyncClient(timeout=120) as client:
                body = chat_body("hi", max_tokens=1000, ignore_eos=True, stream=True,
                                 stream_options={"include_usage": True})
                task = asyncio.create_task(stream_chat(client, base, body))
                while (await asyncio.to_thread(metric_values, base)).get("fw:num_requests_running") != 1:
                    await asyncio.sleep(0.05)
                proc.send_signal(signal.SIGTERM)
                while (health := await client.get(f"{base}/health")).status_code == 200:  # until uvicorn notices
                    await asyncio.sleep(0.05)
                turned_away = await client.post(f"{base}/v1/chat/completions", json=chat_body("late", max_tokens=2))
                still_running = not task.done()
                return await task, turned_away, health, still_running

        (text, usage), turned_away, health, still_running = asyncio.run(scenario())
        assert still_running, "the stream ended before the late request could test draining"
        assert turned_away.status_code == 503 and turned_away.headers["retry-after"] == "1"
        assert turned_away.json()["error"]["type"] == "ServiceUnavailableError"
        assert health.status_code == 503
        assert usage["completion_tokens"] == 1000
        assert proc.wait(timeout=60) == 0


def test_bench_serve_against_fw_serve(server, tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "fw_cli", "bench", "serve", "--base-url", f"{server}/v1", "--num-prompts", "8",
         "--input-len", "8", "--output-len", "6", "--max-concurrency", "4", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["completed"] == 8 and data["failed"] == 0
    assert data["output_throughput"] > 0 and data["ttft_ms_p50"] <= data["e2e_ms_p50"]
    assert "tpot_ms_p99" in result.stdout
    assert data["output_tokens"] == 8 * 6


def test_bench_serve_mixed_lengths(server, tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "fw_cli", "bench", "serve", "--base-url", f"{server}/v1", "--num-prompts", "8",
         "--input-len", "8", "--output-len", "6", "--random-range-ratio", "0.5", "--seed", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    # Outputs of 3 to 9 tokens (ignore_eos), not all 6: seed 1 draws 62 in all.
    assert data["completed"] == 8 and 8 * 3 <= data["output_tokens"] <= 8 * 9 and data["output_tokens"] != 8 * 6


@pytest.mark.parametrize("kind", ["latency", "throughput"])
def test_offline_bench_commands(tiny, kind):
    args = ["--input-len", "8", "--output-len", "4", "--num-kv-blocks", "64", "--max-model-len", "64", "--json",
            "--dtype", "bfloat16"]  # bf16: the kernels are chosen by measurement (float32 stays on the reference)
    args += ["--num-iters", "2"] + (["--num-prompts", "4", "--temperature", "0.8"] if kind == "throughput" else [])
    result = subprocess.run([sys.executable, "-m", "fw_cli", "bench", kind, "--model", tiny, *args],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["decode_tokens_per_s"] if kind == "latency" else data["output_tokens_per_s"]) > 0
    assert data["iterations"] == 2 and data["temperature"] == (0.8 if kind == "throughput" else 0.0)
    assert data["cpu"] and data["threads"] >= 1 and "cpu_flags" in data  # the numbers name their machine
    assert "dense.logits" in data["kernels"]  # and the kernels chosen on it
    key = "decode_tokens_per_s" if kind == "latency" else "output_tokens_per_s"
    assert data[f"{key}_median"] > 0 and data[f"{key}_spread"] >= 0
