"""`fw bench`: offline throughput and latency of the engine, measured, never asserted."""

from __future__ import annotations

import json
import random
import statistics
import time

import click

from fw.config import ResolvedConfig
from fw_cli.options import config_options


@click.group("bench")
def bench() -> None:
    """Measure throughput and latency."""


def _engine(resolved: ResolvedConfig):
    from fw.engine import EngineError, LLMEngine
    from fw.model_loader import ModelLoadError

    try:
        return LLMEngine(resolved.config)
    except (EngineError, ModelLoadError) as exc:
        raise click.ClickException(str(exc)) from None


def _random_prompts(engine, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = engine.executor.runner.hf_config.vocab_size
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def _report(result: dict, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    for key, value in result.items():
        click.echo(f"{key:<28} {value:.4g}" if isinstance(value, float) else f"{key:<28} {value}")


@bench.command("throughput")
@click.option("--num-prompts", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--input-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--output-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@config_options()
def throughput(resolved: ResolvedConfig, num_prompts: int, input_len: int, output_len: int, as_json: bool) -> None:
    """N random-token requests at once, EOS ignored: requests/s and tokens/s."""
    from fw.sampling_params import SamplingParams

    engine = _engine(resolved)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    prompts = _random_prompts(engine, num_prompts, input_len, resolved.config.model.seed)
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, params)
    steps = 0
    with click.progressbar(length=num_prompts * output_len, label="generating", file=click.get_text_stream("stderr")) as bar:
        while engine.has_unfinished_requests():
            steps += 1
            bar.update(len(engine.step()))  # each output of a step carries one new token
    elapsed = time.perf_counter() - start
    engine.shutdown()
    _report(
        {
            "requests": num_prompts,
            "elapsed_s": elapsed,
            "requests_per_s": num_prompts / elapsed,
            "output_tokens_per_s": num_prompts * output_len / elapsed,
            "total_tokens_per_s": num_prompts * (input_len + output_len) / elapsed,
            "engine_steps": steps,
        },
        as_json,
    )


@bench.command("latency")
@click.option("--input-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--output-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--num-iters", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@config_options()
def latency(resolved: ResolvedConfig, input_len: int, output_len: int, num_iters: int, as_json: bool) -> None:
    """One request at a time: time to first token and time per output token (medians over iterations)."""
    from fw.sampling_params import SamplingParams

    engine = _engine(resolved)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ttft, tpot = [], []
    # A different prompt each iteration, so the prefix cache does not flatter the first token.
    prompts = _random_prompts(engine, num_iters + 1, input_len, resolved.config.model.seed)
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        engine.add_request(prompt, params)
        first = None
        while engine.has_unfinished_requests():
            engine.step()
            first = first or time.perf_counter()
        end = time.perf_counter()
        if i:  # the first iteration warms up
            ttft.append(first - start)
            tpot.append((end - first) / max(output_len - 1, 1))
    engine.shutdown()
    _report(
        {
            "iterations": num_iters,
            "ttft_ms_median": 1000 * statistics.median(ttft),
            "tpot_ms_median": 1000 * statistics.median(tpot),
            "decode_tokens_per_s": 1 / statistics.median(tpot),
            "ttft_ms_spread": 1000 * (max(ttft) - min(ttft)),
        },
        as_json,
    )
