"""`fw serve` with no --model: the embedded default (SmolLM2-135M-Instruct, GGUF Q4_1) under the openai client."""

from __future__ import annotations

import json
import re
import subprocess

import jsonschema
import pytest

from conftest import REPO, fw_serve

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def default_start(tmp_path_factory):
    """The default server and its output up to the URL. A kernel cache of its own: the start times its kernels, as
    a first start on a new machine does."""
    cache = tmp_path_factory.mktemp("kernels") / "kernels.json"
    with fw_serve("--max-model-len", "512", "--max-num-seqs", "8", env={"FW_KERNEL_CACHE": str(cache)}) as (base, proc):
        yield base, proc.log().split("fw serve: listening on")[0]


@pytest.fixture(scope="module")
def default_server(default_start):
    return default_start[0]


def test_the_start_reports_kernel_choice_in_one_line(default_start):
    lines = default_start[1].splitlines()
    reports = [line for line in lines if "kernel choice" in line]
    assert len(reports) == 1 and reports[0].startswith("fw: kernel choice (loading the model): "), lines
    details = [line for line in lines if line not in reports and (" chose " in line or "other processes used" in line)]
    assert not details, lines  # each choice's timings, and a busy machine's note, only at DEBUG


def test_openai_client_on_the_default_model(default_server):
    import openai

    client = openai.OpenAI(base_url=f"{default_server}/v1", api_key="unused")
    (model,) = [m.id for m in client.models.list().data]
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=model, messages=question, max_tokens=32, temperature=0)
    assert "Paris" in chat.choices[0].message.content
    assert chat.usage.prompt_tokens > 5 and chat.usage.completion_tokens > 0
    stream = client.chat.completions.create(model=model, messages=question, max_tokens=32, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0,
                                     logprobs=3)
    assert len(comp.choices[0].logprobs.token_logprobs) == comp.usage.completion_tokens
    assert all(len(top) == 3 for top in comp.choices[0].logprobs.top_logprobs)
    lp = client.chat.completions.create(model=model, messages=question, max_tokens=4, temperature=0, logprobs=True,
                                        top_logprobs=2)
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in lp.choices[0].logprobs.content)
    structured = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give the capital of France and its population as JSON."}],
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
    )
    jsonschema.validate(json.loads(structured.choices[0].message.content), SCHEMA)


def test_readme_curl_example_works_as_written(default_server):
    readme = (REPO / "README.md").read_text()
    (command,) = re.findall(r"```bash\n(curl [^`]*?)\n```", readme)
    port = default_server.rsplit(":", 1)[1]
    command = command.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert "Paris" in answer["choices"][0]["message"]["content"]


def test_fw_generate_without_model_uses_the_default(fw_cli):
    result = fw_cli("generate", "--prompt", "The capital of France is", "--max-tokens", "4", "--max-model-len", "256")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The capital of France is")
    assert "quant=gguf" in result.stderr  # the start-up line names the plugins the default model selected
