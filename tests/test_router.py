"""``fw router`` against stand-in instances (small HTTP servers that record what they are sent): the two-step
flow, round-robin, dead instances skipped and brought back, errors, streams. End to end with real ``fw serve``
instances and a KV connector: plugins/kvconnector/p2p/tests/test_kvconnector_p2p.py."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.testclient import TestClient

from conftest import run_fw, wait_until
from fw_cli.router import Router, build_app

PROMPT = {"model": "m", "prompt": "hello", "max_tokens": 5, "min_tokens": 2, "temperature": 0}


class Instance:
    """An HTTP server answering completions as ``name``; ``status`` sets its answer's status."""

    def __init__(self, name: str, status: int = 200) -> None:
        self.name, self.status, self.calls, self.health_checks = name, status, [], 0
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.calls.append({"body": body, "authorization": request.headers.get("authorization")})
            if self.status != 200:
                return JSONResponse({"error": {"message": f"{name} says no"}}, status_code=self.status)
            if body.get("stream"):
                events = [f"data: {json.dumps({'text': f'{name}-{i}'})}\n\n" for i in range(3)] + ["data: [DONE]\n\n"]
                return StreamingResponse(iter(events), media_type="text/event-stream")
            return {"text": name, "kv_transfer_params": {"from": name}}

        @app.get("/health")
        async def health():
            self.health_checks += 1
            return JSONResponse({}, status_code=200 if self.status < 500 else 503)

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        threading.Thread(target=self.server.run, daemon=True).start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once the socket closes


@pytest.fixture
def instances():
    made = []

    def make(name, status=200):
        made.append(Instance(name, status))
        return made[-1]

    yield make
    for instance in made:
        instance.stop()


def client(prefill, decode, **kwargs) -> TestClient:
    return TestClient(build_app(Router(prefill, decode, **kwargs)))


def test_prefill_one_token_then_decode_the_request(instances):
    p, d = instances("p"), instances("d")
    with client([p.url], [d.url]) as c:
        answer = c.post("/v1/completions", json=PROMPT, headers={"Authorization": "Bearer k"})
    assert answer.status_code == 200 and answer.json()["text"] == "d"
    [prefill], [decode] = p.calls, d.calls
    # The prefill computes the prompt and one token: nothing that would stream or lengthen it.
    assert prefill["body"] == {"model": "m", "prompt": "hello", "max_tokens": 1, "temperature": 0}
    # The decode gets the request as the client sent it, with the prefill's transfer parameters.
    assert decode["body"] == {**PROMPT, "kv_transfer_params": {"from": "p"}}
    assert prefill["authorization"] == decode["authorization"] == "Bearer k"


def test_round_robin_over_instances(instances):
    prefills, decodes = [instances(f"p{i}") for i in range(2)], [instances(f"d{i}") for i in range(2)]
    with client([p.url for p in prefills], [d.url for d in decodes]) as c:
        texts = [c.post("/v1/completions", json=PROMPT).json()["text"] for _ in range(4)]
    assert sorted(texts) == ["d0", "d0", "d1", "d1"]
    assert [len(i.calls) for i in prefills + decodes] == [2, 2, 2, 2]


def test_a_dead_instance_is_skipped_and_a_recovered_one_used_again(instances):
    d = instances("d")
    p = instances("p", status=503)  # up but failing: 5xx moves the request on
    dead = dead_url()
    with client([p.url], [dead, d.url], health_interval=0.2) as c:
        for _ in range(3):
            assert c.post("/v1/completions", json=PROMPT).json()["text"] == "d"
        assert len(d.calls) == 3 and len(p.calls) >= 1
        # With no prefill instance answering, the decode instance computed each prompt itself.
        assert all("kv_transfer_params" not in call["body"] for call in d.calls)
        p.status = 200
        checked = p.health_checks
        # Two checks more: the router checks one at a time, so it has taken in the first, which saw p up.
        wait_until(lambda: p.health_checks >= checked + 2)
        calls = len(p.calls)
        c.post("/v1/completions", json=PROMPT)
        assert len(p.calls) == calls + 1


def test_no_decode_instance_is_a_503_in_openai_form(instances):
    p = instances("p")
    with client([p.url], [dead_url(), dead_url()]) as c:
        answer = c.post("/v1/completions", json=PROMPT)
        health = c.get("/health").status_code  # every decode instance is now marked unhealthy
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1" and health == 503
    error = answer.json()["error"]
    assert error["type"] == "service_unavailable" and "no decode instance could take the request" in error["message"]


def test_client_errors_are_answered_as_they_are(instances):
    p, d = instances("p", status=400), instances("d")
    with client([p.url], [d.url]) as c:
        answer = c.post("/v1/completions", json=PROMPT)
        bad = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert answer.status_code == 400 and answer.json()["error"]["message"] == "p says no"
    assert d.calls == []  # the decode instance would refuse it the same way
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "the request body is not valid JSON"


def test_streams_pass_through(instances):
    p, d = instances("p"), instances("d")
    with client([p.url], [d.url]) as c, c.stream("POST", "/v1/completions", json={**PROMPT, "stream": True}) as answer:
        lines = [line for line in answer.iter_lines() if line]
    assert lines == ['data: {"text": "d-0"}', 'data: {"text": "d-1"}', 'data: {"text": "d-2"}', "data: [DONE]"]
    assert "stream" not in p.calls[0]["body"] and d.calls[0]["body"]["stream"] is True


def test_command_line_names_a_bad_url():
    result = run_fw("router", "--decode", "localhost:8000")
    assert result.returncode == 2
    assert "--decode" in result.stderr and "expected an http:// or https:// URL, got 'localhost:8000'" in result.stderr
    assert "Missing option '--decode'" in run_fw("router", "--prefill", "http://a").stderr
