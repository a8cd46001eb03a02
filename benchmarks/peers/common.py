"""What every peer script shares: its virtualenv, the workload, and the JSON it prints.

The workload is `fw bench`'s, token for token: the same seeded random prompt ids, one warm-up before the
timed runs, fresh prompts for each run (no engine gets a prefix-cache hit), greedy decoding with EOS ignored.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS_DIR = Path(os.environ.get("FW_PEERS_DIR", Path.home() / ".cache" / "fw-peers"))
THREADS = 2
# Output tokens of the throughput warm-up batch: enough to reach batched decode, cheap on a slow peer.
WARMUP_TOKENS = 8


def enter_venv(peer: str) -> None:
    """Install the peer if needed and re-run this script with its virtualenv's interpreter."""
    venv = PEERS_DIR / peer / "venv"
    if Path(sys.prefix).resolve() == venv.resolve():
        return
    subprocess.run(["bash", str(HERE / "setup.sh"), peer], check=True, stdout=sys.stderr)
    python = venv / "bin" / "python"
    os.execv(python, [str(python), sys.argv[0], *sys.argv[1:]])


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", help="Checkpoint directory (config.json + safetensors).")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=32, help="Requests of the throughput batch.")
    p.add_argument("--repeats", type=int, default=3, help="Timed runs of each part, after one warm-up.")
    p.add_argument("--seed", type=int, default=0, help="Prompt seed (fw's model.seed, 0 by default).")
    return p


def random_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    """The prompts `fw bench` draws for the same seed and vocabulary."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def _stat(name: str, values: list[float]) -> dict[str, float]:
    return {f"{name}_median": statistics.median(values), f"{name}_spread": max(values) - min(values)}


def run_workload(
    args: argparse.Namespace,
    vocab: int,
    single: Callable[[list[int], int], tuple[float, float]],
    batch: Callable[[list[list[int]], int], None],
) -> dict:
    """Time the latency and throughput parts.

    ``single(prompt, output_len)`` generates one request and returns (first token, last token) perf_counter
    times; ``batch(prompts, output_len)`` generates all prompts at once.
    """
    ttft, decode = [], []
    prompts = random_prompts(vocab, args.repeats + 1, args.input_len, args.seed)
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        first, end = single(prompt, args.output_len)
        if i:  # the first one warms up
            ttft.append(1000 * (first - start))
            decode.append((args.output_len - 1) / (end - first))

    n = args.num_prompts
    prompts = random_prompts(vocab, (args.repeats + 1) * n, args.input_len, args.seed)
    batch(prompts[:n], min(args.output_len, WARMUP_TOKENS))
    output = []
    for r in range(1, args.repeats + 1):
        start = time.perf_counter()
        batch(prompts[r * n : (r + 1) * n], args.output_len)
        output.append(n * args.output_len / (time.perf_counter() - start))
    return {
        **_stat("ttft_ms", ttft),
        **_stat("decode_tokens_per_s", decode),
        **_stat("output_tokens_per_s", output),
        "runs": {"ttft_ms": ttft, "decode_tokens_per_s": decode, "output_tokens_per_s": output},
    }


def emit(engine: str, args: argparse.Namespace, versions: dict, result: dict) -> None:
    workload = {k: getattr(args, k) for k in ("model", "input_len", "output_len", "num_prompts", "repeats", "seed")}
    # One line, last on stdout: libraries log to stdout too, and run_all.py reads the last line.
    print(json.dumps({"engine": engine, "versions": versions, "threads": THREADS, **workload, **result}), flush=True)
