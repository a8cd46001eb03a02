"""The p2p KV connector: the conformance suite over TCP and shared memory, then a prefill engine and a decode engine."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import pytest
import torch

from conftest import free_port, fw_serve, metric_values, together, wait_until
from fw import LLM, SamplingParams
from fw.sdk import side_channel
from fw.testing.conformance import KVConnectorConformance
from fw.testing.models import make_tiny_model
from fw_kvconnector_p2p import connector as p2p


class P2PConformance(KVConnectorConformance):
    plugin = "p2p"

    def connector_options(self, role, tmp_path):
        if not hasattr(self, "port"):  # one producer port per test (pytest makes an instance per test)
            self.port = free_port()
        side = {"port": self.port} if role == "producer" else {"peer": f"127.0.0.1:{self.port}"}
        return {**super().connector_options(role, tmp_path), **self.options, **side}


class TestP2PTCP(P2PConformance):
    options = {"transport": "tcp"}


class TestP2PSharedMemory(P2PConformance):
    options = {"transport": "shm"}


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# 64 shared tokens, then each prompt's own; every length but the first ends in a partial block.
PROMPTS = [{"prompt_token_ids": list(range(3, 67)) + tail} for tail in ([90], [91, 92, 93, 94, 95], list(range(5, 40)))]


# A colocated instance's answers to check_router_in_front_of's requests, by checkpoint content and `fw serve`
# arguments: the connectors' modules write the same tiny checkpoint, and one instance answers for all of them.
_COLOCATED: dict[tuple, list[str]] = {}
_REFERENCE: dict[str, list[list[int]]] = {}  # reference's, by checkpoint digest


def checkpoint_digest(path) -> str:
    """sha256 over a checkpoint folder's file names and bytes."""
    digest = hashlib.sha256()
    for file in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        digest.update(file.relative_to(path).as_posix().encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("p2p") / "llama")


@pytest.fixture(scope="module")
def reference(model):
    """One engine's greedy tokens for PROMPTS; computed once per checkpoint content (the mooncake and nixl modules
    use this fixture on the same tiny checkpoint), a fresh copy for each module."""
    digest = checkpoint_digest(model)
    if digest not in _REFERENCE:
        outputs = LLM(model, num_kv_blocks=64).generate(PROMPTS, GREEDY, use_tqdm=False)
        _REFERENCE[digest] = [o.outputs[0].token_ids for o in outputs]
    return [list(tokens) for tokens in _REFERENCE[digest]]


def p2p_llm(model, prefix_caching=True, connector="p2p", **options):
    return LLM(model, num_kv_blocks=64, kv_connector=connector, plugin_options={"kv_connector": options},
               enable_prefix_caching=prefix_caching)


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_decode_engine_computes_only_the_last_prompt_token(model, reference, transport, monkeypatch):
    pulls = []  # per pull through shared memory: whether it worked

    def pull_shm(self, *args, _real=p2p.P2PWorker._pull_shm):
        data = _real(self, *args)
        pulls.append(data is not None)
        return data

    monkeypatch.setattr(p2p.P2PWorker, "_pull_shm", pull_shm)
    port = free_port()
    producer = p2p_llm(model, role="producer", port=port)
    prefill = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)  # what a router asks a prefill instance
    assert [o.outputs[0].token_ids for o in producer.generate(PROMPTS, prefill, use_tqdm=False)] == [
        r[:1] for r in reference
    ]
    consumer = p2p_llm(model, role="consumer", peer=f"127.0.0.1:{port}", transport=transport, prefix_caching=False)
    outputs = consumer.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    # Every prompt token but the last came from the producer.
    assert [o.num_cached_tokens for o in outputs] == [len(p["prompt_token_ids"]) - 1 for p in PROMPTS]
    stats = consumer.llm_engine.stats().kv_connector
    assert stats.hits == sum(len(p["prompt_token_ids"]) - 1 for p in PROMPTS) and stats.failed_loads == 0
    # auto: both engines are on this host, so shared memory, and it worked.
    assert stats.bytes_loaded > 0 and pulls == ([True] * len(PROMPTS) if transport == "auto" else [])
    assert consumer.llm_engine.kv.num_free_blocks() == 64


def test_unreachable_or_forgetful_producer_means_recompute(model, reference):
    port = free_port()
    producer = p2p_llm(model, role="producer", port=port, buffer_mb=1)
    producer.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    consumer = p2p_llm(model, role="consumer", peer=f"127.0.0.1:{port}", prefix_caching=False)
    # The producer drops its blocks between the lookup and the pull: the load fails, the request computes.
    buffer = producer.llm_engine.executor.runner.kv_connector.server.buffer
    real_get = buffer.get
    buffer.get = lambda hashes: None
    outputs = consumer.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == reference[0] and outputs[0].num_cached_tokens == 0
    assert consumer.llm_engine.stats().kv_connector.failed_loads == 1
    buffer.get = real_get
    producer.llm_engine.shutdown()  # gone: lookups miss
    lonely = p2p_llm(model, role="consumer", peer=f"127.0.0.1:{port}", prefix_caching=False)
    outputs = lonely.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == reference[0]
    assert lonely.llm_engine.stats().kv_connector.hits == 0
    assert lonely.llm_engine.kv.num_free_blocks() == consumer.llm_engine.kv.num_free_blocks() == 64


def test_spec_is_light_and_checks_options():
    import subprocess
    import sys

    from fw.plugins import get_spec

    code = "import sys; from fw.plugins import get_spec; get_spec('kv_connector', 'p2p'); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
    spec = get_spec("kv_connector", "p2p")
    with pytest.raises(ValueError, match="needs peer"):
        spec.parse_options({"role": "consumer"})
    with pytest.raises(ValueError, match="HOST:PORT"):
        spec.parse_options({"peer": "localhost"})
    assert spec.parse_options({"role": "producer"}).transport == "auto"


def connector_args(connector, **options):
    """`fw serve` arguments for a KV connector and its options."""
    args = ["--kv-connector", connector]
    for name, value in options.items():
        args += ["--plugin-option", f"kv_connector.{name}={value}"]
    return tuple(args)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_router_in_front_of_prefill_and_decode_instances(model, transport):
    port = free_port()
    check_router_in_front_of(model, connector_args("p2p", role="producer", port=port),
                             connector_args("p2p", role="consumer", peer=f"127.0.0.1:{port}", transport=transport))


def check_router_in_front_of(model, producer, consumer):
    """32 concurrent requests through `fw router` to a prefill and a decode `fw serve` (``producer``, ``consumer``:
    their KV-connector arguments) answer as one colocated instance does, greedy and seeded; the decode instance
    computed only each prompt's last token."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (int(n),), generator=gen).tolist() for n in torch.randint(20, 90, (32,), generator=gen)]
    bodies = [{"model": "tiny", "prompt": p, "max_tokens": 8, "ignore_eos": True,
               **({"temperature": 0} if i % 2 else {"temperature": 1.0, "seed": i})} for i, p in enumerate(prompts)]

    def answers(base):
        with ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(lambda b: httpx.post(f"{base}/v1/completions", json=b, timeout=120), bodies))
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
        return [r.json()["choices"][0]["text"] for r in replies]

    serve = ("--model", str(model), "--served-model-name", "tiny", "--num-kv-blocks", "256")
    key = (checkpoint_digest(model), serve[2:], json.dumps(bodies))
    # The consumer asks its producer nothing before the first request: the two (and a colocated instance, the
    # first time) start at once.
    colocated = [] if key in _COLOCATED else [fw_serve(*serve)]
    with together(fw_serve(*serve, *producer), fw_serve(*serve, *consumer), *colocated) as started:
        (prefill, _), (decode, _) = started[:2]
        if colocated:
            _COLOCATED[key] = answers(started[2][0])
        with fw_serve("--prefill", prefill, "--decode", decode, command="router") as (router, _):
            got = answers(router)
            metrics = metric_values(decode)
    expected = _COLOCATED[key]
    assert got == expected
    assert metrics["fw:external_prefix_cache_hits_total"] == sum(len(p) - 1 for p in prompts)
    assert metrics["fw:kv_load_failures_total"] == 0


def test_a_decode_instance_killed_mid_request(model):
    """The decode instance dies while a request streams through the router: the client's stream ends with an error
    instead of hanging, later requests get a 503 in OpenAI's form, and the prefill instance holds no block."""
    port = free_port()
    serve = ("--model", str(model), "--served-model-name", "tiny", "--num-kv-blocks", "256")
    body = {"model": "tiny", "prompt": list(range(3, 60)), "max_tokens": 400, "ignore_eos": True, "stream": True}
    with (together(fw_serve(*serve, *connector_args("p2p", role="producer", port=port)),
                   fw_serve(*serve, *connector_args("p2p", role="consumer", peer=f"127.0.0.1:{port}")))
          as ((prefill, _), (decode, proc)),
          fw_serve("--prefill", prefill, "--decode", decode, "--health-interval", "0.5", command="router")
          as (router, _)):
        with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # generating
            proc.send_signal(signal.SIGKILL)
            rest = [line for line in lines if line]
        assert "broke off" in rest[-2] and rest[-1] == "data: [DONE]", rest[-3:]
        after = httpx.post(f"{router}/v1/completions", json={**body, "stream": False}, timeout=60)
        assert after.status_code == 503 and after.json()["error"]["type"] == "service_unavailable"
        producer = metric_values(prefill)
    assert producer["fw:kv_cache_usage_perc"] == 0 and producer["fw:num_requests_running"] == 0


HELD_GET = """
import os, time
from fw.sdk import side_channel as connector

def _answer(self, conn, header, _real=connector.SideChannel._answer):
    if header.get("op") == "get":  # marked as pulled, then held until the test makes the release file
        open(os.environ["FW_TEST_PULL_MARK"], "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(os.environ["FW_TEST_PULL_RELEASE"]) and time.monotonic() < deadline:
            time.sleep(0.01)
    return _real(self, conn, header)

connector.SideChannel._answer = _answer
"""


@contextmanager
def a_pull_in_flight(model, tmp_path, body):
    """A prefill instance that holds every pull until it is released, a decode instance, `fw router` before them,
    and ``body`` sent through the router until the decode instance pulls its KV: yields (prefill URL, prefill
    process, decode URL, decode process, the reply's future, a function that releases the held pulls)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(HELD_GET)
    mark, release = tmp_path / "pulling", tmp_path / "release"
    slow = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]),
            "FW_TEST_PULL_MARK": str(mark), "FW_TEST_PULL_RELEASE": str(release)}
    port = free_port()
    serve = ("--model", str(model), "--served-model-name", "tiny", "--num-kv-blocks", "256")
    with (together(fw_serve(*serve, *connector_args("p2p", role="producer", port=port), env=slow),
                   fw_serve(*serve, *connector_args("p2p", role="consumer", peer=f"127.0.0.1:{port}", transport="shm")))
          as ((prefill, pproc), (decode, dproc)),
          fw_serve("--prefill", prefill, "--decode", decode, "--health-interval", "0.5", command="router")
          as (router, _),
          ThreadPoolExecutor(1) as pool):
        reply = pool.submit(httpx.post, f"{router}/v1/completions", json=body, timeout=60)
        deadline = time.monotonic() + 60
        while not mark.exists():
            assert time.monotonic() < deadline and not reply.done(), "the decode instance never pulled"
            time.sleep(0.05)
        yield prefill, pproc, decode, dproc, reply, release.touch


PULLED = {"model": "tiny", "prompt": list(range(3, 60)), "max_tokens": 4, "ignore_eos": True, "temperature": 0}


def test_a_decode_instance_killed_during_a_transfer(model, tmp_path):
    """The decode instance dies while it pulls: the client gets an error instead of hanging, the prefill instance
    holds no block and keeps serving, and the dead consumer's shared-memory file does not outlive it."""
    with a_pull_in_flight(model, tmp_path, PULLED) as (prefill, pproc, _, dproc, reply, release):
        files = list(side_channel.SHM_DIR.glob(f"{side_channel.SHM_PREFIX}{dproc.pid}-*"))
        assert files  # the pull's file, which the consumer would have removed
        dproc.send_signal(signal.SIGKILL)
        assert reply.result().status_code >= 500
        release()  # the producer's held answer finds the consumer gone, and removes its file
        wait_until(lambda: not any(f.exists() for f in files))
        producer = metric_values(prefill)
        assert producer["fw:kv_cache_usage_perc"] == 0 and producer["fw:num_requests_running"] == 0
        try:
            again = httpx.post(f"{prefill}/v1/completions", json=PULLED, timeout=60)
        except httpx.TimeoutException:
            pytest.fail(f"the prefill instance stopped answering; its log ends: {pproc.log()[-3000:]}")
        assert again.status_code == 200


def test_a_prefill_instance_killed_before_it_sends(model, tmp_path):
    """The prefill instance dies holding a pull: the decode instance computes the prompt itself, answers as it
    would alone, and holds no block afterwards."""
    with a_pull_in_flight(model, tmp_path, PULLED) as (_, pproc, decode, _, reply, _):
        pproc.send_signal(signal.SIGKILL)
        assert reply.result().status_code == 200
        alone = httpx.post(f"{decode}/v1/completions", json=PULLED, timeout=60)
        assert reply.result().json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
        consumer = metric_values(decode)
    assert consumer["fw:kv_load_failures_total"] == 1
    assert consumer["fw:kv_cache_usage_perc"] == 0 and consumer["fw:num_requests_running"] == 0


def test_a_dead_consumers_shared_memory_files_are_swept():
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = side_channel.SHM_DIR / f"{side_channel.SHM_PREFIX}{int(dead.stdout)}-x"
    live = side_channel.SHM_DIR / f"{side_channel.SHM_PREFIX}{os.getpid()}-x"
    for path in (stale, live):
        path.write_bytes(b"kv")
    try:
        p2p.P2PWorker(None)  # a consumer starting (transport auto) sweeps
        assert not stale.exists() and live.exists()
    finally:
        for path in (stale, live):
            path.unlink(missing_ok=True)


def settled(registrations, staged, within=5.0):
    """Waits for ``staged`` copies to have been made and dropped (a copy goes when its consumer hangs up, a moment
    after the pull ended); returns how many were made and how many are still held."""
    deadline = time.monotonic() + within
    while (registrations.staged < staged or registrations.held) and time.monotonic() < deadline:
        time.sleep(0.05)
    return registrations.staged, len(registrations.held)


def check_staged_loads(model, reference, producer_with, make_llm):
    """A consumer loads every prompt's blocks but the last token's from a producer that stages them for a transfer
    library (``producer_with(model, prompts, **registrations)``: the producer, its port, its staging record;
    ``make_llm``: an engine with the connector): one staging per prompt, all released, nothing held."""
    producer, port, registrations = producer_with(model, PROMPTS)
    consumer = make_llm(model, role="consumer", peer=f"127.0.0.1:{port}", prefix_caching=False)
    outputs = consumer.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert [o.num_cached_tokens for o in outputs] == [len(p["prompt_token_ids"]) - 1 for p in PROMPTS]
    stats = consumer.llm_engine.stats().kv_connector
    assert stats.hits == sum(len(p["prompt_token_ids"]) - 1 for p in PROMPTS) and stats.failed_loads == 0
    assert settled(registrations, len(PROMPTS)) == (len(PROMPTS), 0)
    assert consumer.llm_engine.kv.num_free_blocks() == producer.llm_engine.kv.num_free_blocks() == 64


def check_refused_read_and_producer_gone(model, reference, producer_with, make_llm):
    """The library refuses the staged read, then the producer is gone between the lookup and the pull: each time
    the request computes its prompt and nothing leaks."""
    producer, port, registrations = producer_with(model, PROMPTS[:1], refuse=True)
    consumer = make_llm(model, role="consumer", peer=f"127.0.0.1:{port}", prefix_caching=False)
    outputs = consumer.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert_computed_and_freed(outputs, reference, consumer, producer)
    assert settled(registrations, 1) == (1, 0)
    registrations.refuse = False
    worker = consumer.llm_engine.executor.runner.kv_connector
    start_load_kv = worker.start_load_kv

    def producer_dies_first(meta):
        if meta.loads:
            producer.llm_engine.shutdown()
        start_load_kv(meta)

    worker.start_load_kv = producer_dies_first
    assert_computed_and_freed(consumer.generate(PROMPTS[:1], GREEDY, use_tqdm=False), reference, consumer, producer, 2)


def test_a_silent_producer_costs_one_wait_not_one_per_request():
    import socket

    from fw_kvconnector_p2p.spec import P2POptions

    with socket.socket() as silent:  # connections complete (the backlog) but nothing ever answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        scheduler = side_channel.P2PScheduler(P2POptions(role="consumer", peer=f"127.0.0.1:{port}", timeout=0.3), 16)
        offers = [scheduler.get_num_new_matched_tokens(str(i), list(range(3, 43)), 0) for i in range(5)]
        silent.setblocking(False)
        asked = 0  # connections made: each wait ends its connection, and each new ask connects again
        with suppress(BlockingIOError):
            while True:
                silent.accept()[0].close()
                asked += 1
    assert offers == [0] * 5
    assert asked == 1  # one wait; then the producer counts as down (for 0.3 s) instead of being asked each time


def test_buffer_drops_the_least_recently_used_and_the_side_channel_answers():
    import socket

    buffer = side_channel.BlockBuffer(capacity=16)
    buffer.put(1, b"a" * 8)
    buffer.put(2, b"b" * 8)
    assert buffer.count_prefix([1]) == 1  # touches 1: 2 is now the least recent
    buffer.put(3, b"c" * 8)
    assert buffer.count_prefix([1, 3]) == 2 and buffer.get([2]) is None
    server = side_channel.SideChannel("127.0.0.1", 0, buffer, [[[2, 4], "torch.float32"]])
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            side_channel.send_message(sock, {"op": "have", "hashes": [1, 3, 2, 1]})
            assert side_channel.recv_message(sock)[0]["count"] == 2  # a prefix: nothing past the missing 2
            side_channel.send_message(sock, {"op": "get", "hashes": [3, 1]})
            reply, payload = side_channel.recv_message(sock)
            assert reply["ok"] and payload == b"c" * 8 + b"a" * 8
            # Only files a consumer made for a pull are written, never another /dev/shm file.
            side_channel.send_message(sock, {"op": "get", "hashes": [1], "shm": "victim"})
            assert side_channel.recv_message(sock)[0]["error"].startswith("shm:")
    finally:
        server.close()


@pytest.fixture
def held_pulls(monkeypatch):
    """The producer holds each pull's answer until the event this returns is set (at the latest when the test
    ends)."""
    release = threading.Event()
    real = side_channel.SideChannel._answer

    def answer(self, conn, header):
        if header.get("op") == "get":
            release.wait(120)
        real(self, conn, header)

    monkeypatch.setattr(side_channel.SideChannel, "_answer", answer)
    yield release
    release.set()


def test_a_pull_past_its_timeout_is_computed_and_nothing_leaks(model, reference, held_pulls):
    port = free_port()
    producer = p2p_llm(model, role="producer", port=port)
    producer.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    consumer = p2p_llm(model, role="consumer", peer=f"127.0.0.1:{port}", timeout=0.5, prefix_caching=False)
    # Done while the answer is held: computed, not waited for (a load that waited would find the KV and use it).
    outputs = consumer.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert_computed_and_freed(outputs, reference, consumer, producer)


def assert_computed_and_freed(outputs, reference, consumer, producer, failed_loads=1):
    """PROMPTS[0] computed its whole prompt, its load counted failed, and neither engine holds a block."""
    assert outputs[0].outputs[0].token_ids == reference[0] and outputs[0].num_cached_tokens == 0
    assert consumer.llm_engine.stats().kv_connector.failed_loads == failed_loads
    assert consumer.llm_engine.kv.num_free_blocks() == producer.llm_engine.kv.num_free_blocks() == 64


def test_abort_during_a_pull_frees_the_blocks_once_the_pull_ends(model, held_pulls):
    port = free_port()
    producer = p2p_llm(model, role="producer", port=port)
    producer.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    engine = p2p_llm(model, role="consumer", peer=f"127.0.0.1:{port}", prefix_caching=False).llm_engine
    engine.add_request(PROMPTS[0], GREEDY, request_id="r")
    engine.step()
    assert "r" in engine.scheduler.transfers.loading
    engine.abort_request("r")
    assert engine.kv.num_free_blocks() < 64  # the pull may still land in them
    held_pulls.set()
    wait_until(lambda: not engine.has_unfinished_requests() or engine.step() is None)  # steps until nothing is left
    assert engine.kv.num_free_blocks() == producer.llm_engine.kv.num_free_blocks() == 64
