"""The cost of TP=2, PP=2 and EP=2 against one process, and the share of a decode step spent communicating
(issue 18's benchmark).

    python benchmarks/parallel_comm.py DENSE_MODEL [--moe-model DIR] [--output-len 32]

DENSE_MODEL: e.g. the Qwen2-0.5B-shaped checkpoint of ``peers/make_model.py``. Without ``--moe-model``, a
Qwen3-MoE-shaped bf16 checkpoint (8 layers, 16 experts of 768, 4 per token: about 250M parameters) is written
to a temporary directory. Each configuration: TTFT of a 128-token prompt, then single-stream decode. Rank 0
runs in this process, so its communicator (the ``torch`` comm plugin's class) and the control plane are timed
here: "comm" is rank 0's time inside collectives, send/recv and dispatch/combine (waiting for the other rank
included), "control" its time broadcasting each step's inputs; both as a share of rank 0's decode steps.
Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

from fw import LLM, SamplingParams, distributed, executor, plugins
from fw.sdk.kernels import machine, relevant_flags
from fw.testing.models import make_tiny_model

TIMED = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv", "dispatch", "combine")


class Clock:
    """Seconds spent in the wrapped calls; a call made inside another timed call is not counted twice."""

    def __init__(self) -> None:
        self.seconds = {"comm": 0.0, "control": 0.0, "step": 0.0}
        self.depth = 0

    def wrap(self, owner: type, name: str, bucket: str) -> None:
        real = getattr(owner, name)

        @functools.wraps(real)
        def timed(*args, **kwargs):
            if self.depth:
                return real(*args, **kwargs)
            self.depth += 1
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.seconds[bucket] += time.perf_counter() - start
                self.depth -= 1

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)


def install(clock: Clock) -> None:
    comm_cls, _ = plugins.load_driver("comm", "torch")
    for name in TIMED:
        if name in vars(comm_cls):
            clock.wrap(comm_cls, name, "comm")
    clock.wrap(distributed.ControlPlane, "broadcast", "control")
    # Executor.execute times the whole step, and the control plane broadcast happens inside it.
    real_execute = executor.Executor.execute

    def execute(self, inputs):
        start, depth = time.perf_counter(), clock.depth
        clock.depth = 0
        try:
            return real_execute(self, inputs)
        finally:
            clock.depth = depth
            clock.seconds["step"] += time.perf_counter() - start

    executor.Executor.execute = execute


def measure(model: Path, settings: dict, output_len: int, iters: int, clock: Clock) -> dict:
    llm = LLM(str(model), max_model_len=512, **settings)
    prompt = [{"prompt_token_ids": [(i * 31) % 500 + 10 for i in range(128)]}]
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    decode = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    llm.generate(prompt, decode, use_tqdm=False)  # warm-up: kernels chosen, caches touched
    ttft, rate, comm, control = [], [], [], []
    for _ in range(iters):
        start = time.perf_counter()
        llm.generate(prompt, first, use_tqdm=False)
        ttft.append(time.perf_counter() - start)
        llm.generate(prompt, first, use_tqdm=False)
        clock.reset()
        start = time.perf_counter()
        llm.generate(prompt, decode, use_tqdm=False)
        # The prompt's KV is cached: this run is one 1-token prefill step, then decode steps.
        rate.append((output_len - 1) / (time.perf_counter() - start))
        comm.append(clock.seconds["comm"] / clock.seconds["step"])
        control.append(clock.seconds["control"] / clock.seconds["step"])
    llm.shutdown()

    def med(values: list[float], scale: float = 1.0) -> str:
        return f"{statistics.median(values) * scale:.1f} ({(max(values) - min(values)) * scale:.1f})"

    return {"TTFT ms": med(ttft, 1000), "decode tok/s": med(rate), "comm share": med(comm, 100) + " %",
            "control share": med(control, 100) + " %"}


def moe_model(path: Path) -> Path:
    return make_tiny_model(
        "Qwen3MoeForCausalLM", path, dtype="bfloat16", vocab_size=32000, hidden_size=768, num_hidden_layers=8,
        num_attention_heads=12, num_key_value_heads=4, head_dim=64, intermediate_size=2048, moe_intermediate_size=768,
        num_experts=16, num_experts_per_tok=4, max_position_embeddings=1024,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dense_model")
    parser.add_argument("--moe-model")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-iters", type=int, default=2)
    args = parser.parse_args()
    info = machine()
    print(f"cpu: {info['cpu']} | flags: {relevant_flags(info['flags'])} | threads {info['threads']}")
    clock = Clock()
    install(clock)
    with tempfile.TemporaryDirectory() as scratch:
        moe = Path(args.moe_model) if args.moe_model else moe_model(Path(scratch) / "moe")
        runs = [
            ("dense", args.dense_model, "one process", {}),
            ("dense", args.dense_model, "-tp 2", {"tensor_parallel_size": 2}),
            ("dense", args.dense_model, "-pp 2", {"pipeline_parallel_size": 2}),
            ("moe", moe, "one process", {}),
            ("moe", moe, "-tp 2", {"tensor_parallel_size": 2}),
            ("moe", moe, "-tp 2 --enable-expert-parallel (EP=2)",
             {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
        ]
        print("| model | configuration | TTFT ms | decode tok/s | comm share | control share |")
        print("|---|---|---|---|---|---|")
        for kind, model, name, settings in runs:
            row = measure(Path(model), settings, args.output_len, args.num_iters, clock)
            print(f"| {kind} | {name} | " + " | ".join(row.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
