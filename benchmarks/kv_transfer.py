"""KV transfer throughput of each KV connector on this host against a plain memory copy (issue 19's benchmark).

    python benchmarks/kv_transfer.py [--tokens 4096] [--runs 3] [--connectors p2p-tcp,p2p-shm,...]

A producer engine computes a prompt of ``--tokens`` tokens (64 MiB of float32 KV with the default model); a
consumer engine in this process loads every block but the last token's through the connector. Throughput is the
bytes the consumer loaded over the time its connector reports for the loads (from the pull's start to the engine
seeing it done, the copy into the KV cache included), each run a fresh prompt. The baseline copies the same bytes
with ``Tensor.copy_``. Connectors whose library is not installed are skipped, saying so (LMCache lives in a
virtualenv of its own: run the script there for it). Stores get a server of their own on 127.0.0.1 (Mooncake's
master, LMCache's server). Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fw import LLM, SamplingParams
from fw.sdk.kernels import machine, relevant_flags
from fw.testing.models import make_tiny_model

BLOCK = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def side_channel(name: str, **extra) -> Callable[[str], tuple[dict, dict]]:
    """Producer and consumer options of a connector built on p2p's side channel."""

    def options(_: str) -> tuple[dict, dict]:
        port = free_port()
        return ({"role": "producer", "port": port, **extra},
                {"role": "consumer", "peer": f"127.0.0.1:{port}", **extra})

    return options


def shared_directory(workdir: str) -> tuple[dict, dict]:
    return {"role": "producer", "path": workdir}, {"role": "consumer", "path": workdir}


def server(command: list[str], port: int, workdir: str) -> None:
    """Start a store's server for this run (stopped at exit) and wait for its port."""
    log = open(Path(workdir) / "server.log", "w")  # noqa: SIM115 - open while the server runs
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    atexit.register(proc.terminate)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{command[2]} did not start: {Path(log.name).read_text()}") from None
            time.sleep(0.2)


def mooncake_store(workdir: str) -> tuple[dict, dict]:
    rpc = free_port()
    server([sys.executable, "-m", "mooncake.cli", "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
            "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}"], rpc, workdir)
    store = {"mode": "store", "master": f"127.0.0.1:{rpc}"}
    return {"role": "producer", **store}, {"role": "consumer", **store}


def lmcache_server(workdir: str) -> tuple[dict, dict]:
    port = free_port()
    server([sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"], port, workdir)
    store = {"backend": f"lm://127.0.0.1:{port}"}
    return {"role": "producer", **store}, {"role": "consumer", **store}


# name -> (plugin, module it needs, options for a producer and a consumer given a scratch directory)
CONNECTORS: dict[str, tuple[str, str | None, Callable[[str], tuple[dict, dict]]]] = {
    "p2p-tcp": ("p2p", None, side_channel("p2p", transport="tcp")),
    "p2p-shm": ("p2p", None, side_channel("p2p", transport="shm")),
    "mooncake": ("mooncake", "mooncake", side_channel("mooncake")),
    "mooncake-store": ("mooncake", "mooncake", mooncake_store),
    "nixl": ("nixl", "nixl", side_channel("nixl")),
    "lmcache-server": ("lmcache", "lmcache", lmcache_server),
    "disk": ("disk", None, shared_directory),
}


def run_connector(model: Path, plugin: str, options, tokens: int, runs: int) -> list[float]:
    """GB/s of each run's load."""
    blocks = tokens // BLOCK + 2
    with tempfile.TemporaryDirectory() as workdir:
        producer_options, consumer_options = options(workdir)
        engine = {"num_kv_blocks": blocks, "max_model_len": tokens + 8, "kv_connector": plugin}
        producer = LLM(str(model), plugin_options={"kv_connector": producer_options}, **engine)
        consumer = LLM(str(model), plugin_options={"kv_connector": consumer_options}, enable_prefix_caching=False,
                       **engine)
        one = SamplingParams(max_tokens=1, temperature=0)
        rates = []
        for run in range(runs):
            prompt = [{"prompt_token_ids": [(run * 7919 + i * 31) % 250 + 3 for i in range(tokens)]}]
            producer.generate(prompt, one, use_tqdm=False)
            before = consumer.llm_engine.stats().kv_connector
            loaded, seconds = before.bytes_loaded, before.seconds
            consumer.generate(prompt, one, use_tqdm=False)
            stats = consumer.llm_engine.stats().kv_connector
            if stats.failed_loads or stats.bytes_loaded == loaded:
                raise RuntimeError(f"{plugin}: the consumer computed the prompt instead of loading it")
            rates.append((stats.bytes_loaded - loaded) / (stats.seconds - seconds) / 1e9)
        nbytes = stats.bytes_loaded - loaded
        for llm in (consumer, producer):
            llm.shutdown()
    print(f"  ({nbytes / 2**20:.1f} MiB a load)")
    return rates


def memcpy(nbytes: int, runs: int) -> list[float]:
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # first touch
    rates = []
    for _ in range(runs):
        start = time.perf_counter()
        dst.copy_(src)
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    return rates


def report(name: str, rates: list[float]) -> None:
    print(f"{name}: {statistics.median(rates):.2f} GB/s (spread {max(rates) - min(rates):.2f}, {len(rates)} runs)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--connectors", default=",".join(CONNECTORS))
    args = parser.parse_args()
    info = machine()
    print(f"cpu: {info['cpu']} | flags: {relevant_flags(info['flags'])} | threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as scratch:
        # 4 layers x 8 KV heads x 64 dims, float32: 16 KiB of KV a token.
        model = make_tiny_model("LlamaForCausalLM", Path(scratch) / "model", hidden_size=512, num_hidden_layers=4,
                                num_attention_heads=8, num_key_value_heads=8, head_dim=64, intermediate_size=1024,
                                max_position_embeddings=args.tokens + 64)
        report("memcpy (Tensor.copy_)", memcpy(args.tokens * 16 * 1024, args.runs))
        for name in args.connectors.split(","):
            plugin, module, options = CONNECTORS[name]
            if module is not None and importlib.util.find_spec(module) is None:
                print(f"{name}: skipped, module {module} is not installed")
                continue
            report(name, run_connector(model, plugin, options, args.tokens, args.runs))


if __name__ == "__main__":
    main()
