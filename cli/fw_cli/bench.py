"""`fw bench`: offline throughput and latency of the engine, measured, never asserted."""

from __future__ import annotations

import json
import random
import statistics
import time
from typing import TYPE_CHECKING

import click

from fw.config import ResolvedConfig
from fw_cli.options import config_options

if TYPE_CHECKING:
    from fw.engine.client import SyncEngineClient

# Output tokens of the throughput warm-up batch: enough to reach batched decode.
_WARMUP_TOKENS = 8


@click.group("bench")
def bench() -> None:
    """Measure throughput and latency."""


def _engine(resolved: ResolvedConfig):
    from fw.engine import EngineError, LLMEngine
    from fw.sdk.errors import ModelLoadError

    try:
        return LLMEngine(resolved.config)
    except (EngineError, ModelLoadError) as exc:
        raise click.ClickException(str(exc)) from None


def _random_prompts(engine: SyncEngineClient, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = engine.view.vocab_size
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def _median_spread(name: str, values: list[float]) -> dict[str, float]:
    return {f"{name}_median": statistics.median(values), f"{name}_spread": max(values) - min(values)}


def _machine() -> dict:
    """The CPU the numbers belong to and the kernels fw chose on it (``fw.sdk.kernels``)."""
    from fw.sdk import kernels

    info = kernels.machine()
    return {"cpu": info["cpu"], "cpu_flags": kernels.relevant_flags(info["flags"]), "threads": info["threads"],
            "kernels": kernels.chosen()}


def _spec_decode(engine: SyncEngineClient) -> dict:
    """With speculative decoding: the drafts verified and the fraction accepted."""
    stats = engine.stats().spec_decode
    if stats is None:
        return {}
    rate = stats.acceptance_rate
    return {"spec_draft_tokens": stats.num_draft_tokens, "spec_acceptance_rate": rate if rate is not None else "n/a"}


def _report(result: dict, as_json: bool, engine_here: bool = True, profile: dict | None = None) -> None:
    if engine_here:
        result = {**result, **_machine()}
    if as_json:
        click.echo(json.dumps(result if profile is None else {**result, "profile": profile}, indent=2))
        return
    for key, value in result.items():
        if key == "kernels":
            click.echo("kernels (rows: candidate)")
            for op, shapes in value.items():
                for shape, choice in shapes.items():
                    click.echo(f"  {op} {shape}: " + ", ".join(f"{rows} {name}" for rows, name in choice.items()))
        else:
            click.echo(f"{key:<28} {value:.4g}" if isinstance(value, float) else f"{key:<28} {value}")
    if profile is not None:
        replayed = "; the timed iterations replayed captured steps" if profile["captured"] else ""
        click.echo(f"decode step profile: {profile['steps']} steps, {profile['step_ms']:.2f} ms a step, run eagerly "
                   f"with a timer at each plugin boundary{replayed}")
        click.echo(f"  {'part':<44} {'ms/step':>8} {'share':>7}")
        for row in profile["parts"]:
            click.echo(f"  {row['part']:<44} {row['ms_per_step']:>8.3f} {100 * row['share']:>6.1f}%")


def _temperature(fn):
    return click.option(
        "--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
        help="Sampling temperature of every request; 0 is greedy, as the peers' scripts run (vLLM's own latency and "
             "throughput benchmarks sample at 1.0).")(fn)


@bench.command("throughput")
@click.option("--num-prompts", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--input-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--output-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--num-iters", type=click.IntRange(min=1), default=1, show_default=True,
              help="Timed batches, after a short warm-up batch (medians and spreads over them).")
@_temperature
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@config_options()
def throughput(resolved: ResolvedConfig, num_prompts: int, input_len: int, output_len: int, num_iters: int,
               temperature: float, as_json: bool) -> None:
    """N random-token requests at once, EOS ignored: requests/s and tokens/s."""
    from fw.sdk.sampling_params import SamplingParams

    engine = _engine(resolved)
    # Fresh prompts for every batch, so the prefix cache does not flatter the repeats.
    prompts = _random_prompts(engine, (num_iters + 1) * num_prompts, input_len, resolved.config.model.seed)
    batches = [prompts[i * num_prompts : (i + 1) * num_prompts] for i in range(num_iters + 1)]

    def run(batch: list[list[int]], max_tokens: int, bar=None) -> tuple[float, int]:
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
        start, steps = time.perf_counter(), 0
        for prompt in batch:
            engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            steps += 1
            outputs = engine.step()
            if bar is not None:
                bar.update(len(outputs))  # each output of a step carries one new token
        return time.perf_counter() - start, steps

    # A few tokens of the same batch: its prefill and batched decode run once before the clock does.
    run(batches[0], min(output_len, _WARMUP_TOKENS))
    elapsed, steps = [], []
    with click.progressbar(length=num_iters * num_prompts * output_len, label="generating",
                           file=click.get_text_stream("stderr")) as bar:
        for batch in batches[1:]:
            seconds, n = run(batch, output_len, bar)
            elapsed.append(seconds)
            steps.append(n)
    spec = _spec_decode(engine)
    engine.shutdown()
    output_rates = [num_prompts * output_len / s for s in elapsed]
    total_rates = [num_prompts * (input_len + output_len) / s for s in elapsed]
    _report(
        {
            "requests": num_prompts,
            "iterations": num_iters,
            "temperature": temperature,
            # The plain keys are medians over the iterations.
            "elapsed_s": statistics.median(elapsed),
            "requests_per_s": statistics.median(num_prompts / s for s in elapsed),
            "output_tokens_per_s": statistics.median(output_rates),
            "total_tokens_per_s": statistics.median(total_rates),
            "engine_steps": statistics.median(steps),
            **_median_spread("output_tokens_per_s", output_rates),
            **_median_spread("total_tokens_per_s", total_rates),
            **spec,
        },
        as_json,
    )


@bench.command("latency")
@click.option("--input-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--output-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Requests started together and decoded as one batch.")
@click.option("--num-iters", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--profile", is_flag=True,
              help="Then decode one more batch with timers at the plugin boundaries and print where a decode step "
                   "goes: linear kernels per quant method, attention, LM head, sampling, Python (fw.engine.step_profile).")
@_temperature
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@config_options()
def latency(resolved: ResolvedConfig, input_len: int, output_len: int, batch_size: int, num_iters: int,
            profile: bool, temperature: float, as_json: bool) -> None:
    """A batch at a time (one request by default): time to first token and time per output token (medians over
    iterations, after one that warms up)."""
    from fw.sdk.sampling_params import SamplingParams

    engine = _engine(resolved)
    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True)
    ttft, tpot = [], []
    # Different prompts each iteration, so the prefix cache does not flatter the first token.
    prompts = _random_prompts(engine, (num_iters + 1 + profile) * batch_size, input_len, resolved.config.model.seed)
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    for i, batch in enumerate(batches[: num_iters + 1]):
        start = time.perf_counter()
        _prefill(engine, batch, params)
        first = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        if i:  # the first iteration warms up
            ttft.append(first - start)
            tpot.append((time.perf_counter() - first) / max(output_len - 1, 1))
    parts = _profile(engine, batches[-1], params) if profile else None
    spec = _spec_decode(engine)
    engine.shutdown()
    _report(
        {
            "iterations": num_iters,
            "batch_size": batch_size,
            "temperature": temperature,
            "ttft_ms_median": 1000 * statistics.median(ttft),
            "tpot_ms_median": 1000 * statistics.median(tpot),
            "decode_tokens_per_s": batch_size / statistics.median(tpot),
            "ttft_ms_spread": 1000 * (max(ttft) - min(ttft)),
            **_median_spread("decode_tokens_per_s", [batch_size / t for t in tpot]),
            **spec,
        },
        as_json,
        profile=parts,
    )


def _prefill(engine: SyncEngineClient, batch: list[list[int]], params) -> None:
    """Adds the batch and steps until each of its requests has its first token."""
    for prompt in batch:
        engine.add_request(prompt, params)
    started: set[str] = set()
    while len(started) < len(batch) and engine.has_unfinished_requests():
        started.update(out.request_id for out in engine.step())


def _profile(engine: SyncEngineClient, batch: list[list[int]], params) -> dict:
    """The decode steps of one more batch, timed by part (``fw.engine.step_profile``): {"steps", "step_ms", "parts":
    [{"part", "ms_per_step", "share"}]}."""
    from fw.engine.step_profile import StepProfile

    _prefill(engine, batch, params)
    with StepProfile(engine) as profile:
        while engine.has_unfinished_requests():
            engine.step()
    rows = profile.table()
    return {"steps": profile.steps, "step_ms": sum(ms for _, ms, _ in rows), "captured": profile.captured,
            "parts": [{"part": part, "ms_per_step": ms, "share": share} for part, ms, share in rows]}


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p95": float("nan"), "p99": float("nan")}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)]

    return {"p50": pick(0.50), "p95": pick(0.95), "p99": pick(0.99)}


async def _one_request(client, url: str, body: dict) -> dict:
    """Stream one completion; per-chunk arrival times give TTFT and inter-token latencies."""
    start = time.perf_counter()
    arrivals, output_tokens, error = [], None, None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if data.get("usage"):
                        output_tokens = data["usage"]["completion_tokens"]
                    if any(c.get("text") for c in data.get("choices", [])):
                        arrivals.append(time.perf_counter())
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    return {"start": start, "end": end, "arrivals": arrivals, "output_tokens": output_tokens or len(arrivals),
            "error": error}


@bench.command("serve")
@click.option("--base-url", default="http://127.0.0.1:8000/v1", show_default=True, help="Any OpenAI-compatible server.")
@click.option("--model", "model_name", default=None, help="Model name to send (default: the server's first model).")
@click.option("--num-prompts", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--input-len", type=click.IntRange(min=1), default=128, show_default=True, help="Prompt length in words.")
@click.option("--random-ids", "vocab_size", type=click.IntRange(min=1), default=None, metavar="VOCAB_SIZE",
              help="Prompts of --input-len random token ids below VOCAB_SIZE, as the offline benches send, not words.")
@click.option("--output-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--random-range-ratio", type=click.FloatRange(0, 1, max_open=True), default=0.0, show_default=True,
              help="Mixed lengths: each prompt's and output's length drawn uniformly within this fraction of "
                   "--input-len and --output-len.")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=None, help="Requests in flight at most.")
@click.option("--request-rate", type=float, default=float("inf"), show_default=True,
              help="Poisson arrivals per second (inf: all at once, bounded by --max-concurrency).")
@click.option("--slo-ttft-ms", type=float, default=None, help="Goodput: a request counts only if its TTFT is below.")
@click.option("--slo-tpot-ms", type=float, default=None, help="Goodput: ... and its TPOT is below.")
@click.option("--api-key", default=None, envvar="OPENAI_API_KEY")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Also write the result here.")
def serve_bench(base_url, model_name, num_prompts, input_len, vocab_size, output_len, random_range_ratio,
                max_concurrency, request_rate, slo_ttft_ms, slo_tpot_ms, api_key, seed, json_path) -> None:
    """Load an OpenAI-compatible server (ours, vLLM's, SGLang's) with streaming completions."""
    import asyncio

    import httpx

    rng = random.Random(seed)
    words = ["alpha", "river", "stone", "quiet", "metal", "orange", "window", "seven", "cloud", "paper"]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def length(mean: int) -> int:
        return max(1, round(mean * rng.uniform(1 - random_range_ratio, 1 + random_range_ratio)))

    async def run() -> tuple[list[dict], float]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600), headers=headers,
                                     limits=httpx.Limits(max_connections=max_concurrency or num_prompts)) as client:
            name = model_name or (await client.get(f"{base_url}/models")).json()["data"][0]["id"]
            limit = asyncio.Semaphore(max_concurrency or num_prompts)

            async def guarded(body):
                async with limit:
                    return await _one_request(client, f"{base_url}/completions", body)

            tasks, start = [], time.perf_counter()
            with click.progressbar(length=num_prompts, label="requests", file=click.get_text_stream("stderr")) as bar:
                for _ in range(num_prompts):
                    n = length(input_len)
                    if vocab_size:
                        prompt = [rng.randrange(vocab_size) for _ in range(n)]
                    else:
                        prompt = " ".join(rng.choice(words) for _ in range(n))
                    body = {"model": name, "prompt": prompt,
                            "max_tokens": length(output_len), "temperature": 0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
                    tasks.append(asyncio.create_task(guarded(body)))
                    if request_rate != float("inf"):
                        await asyncio.sleep(rng.expovariate(request_rate))
                results = []
                for task in asyncio.as_completed(tasks):
                    results.append(await task)
                    bar.update(1)
            return results, time.perf_counter() - start

    results, duration = asyncio.run(run())
    ok = [r for r in results if r["error"] is None and r["arrivals"]]
    ttft = [1000 * (r["arrivals"][0] - r["start"]) for r in ok]
    tpot = [1000 * (r["end"] - r["arrivals"][0]) / max(r["output_tokens"] - 1, 1) for r in ok]
    itl = [1000 * (b - a) for r in ok for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False)]
    e2e = [1000 * (r["end"] - r["start"]) for r in ok]
    good = [r for r, t, p in zip(ok, ttft, tpot, strict=True)
            if (slo_ttft_ms is None or t <= slo_ttft_ms) and (slo_tpot_ms is None or p <= slo_tpot_ms)]
    out_tokens = sum(r["output_tokens"] for r in ok)
    result = {
        "base_url": base_url, "num_prompts": num_prompts, "completed": len(ok), "failed": len(results) - len(ok),
        "output_tokens": out_tokens,
        "duration_s": duration, "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "goodput_requests_per_s": len(good) / duration,
        **{f"ttft_ms_{k}": v for k, v in _percentiles(ttft).items()},
        **{f"tpot_ms_{k}": v for k, v in _percentiles(tpot).items()},
        **{f"itl_ms_{k}": v for k, v in _percentiles(itl).items()},
        **{f"e2e_ms_{k}": v for k, v in _percentiles(e2e).items()},
    }
    errors = [r["error"] for r in results if r["error"]]
    if errors:
        click.echo(f"{len(errors)} request(s) failed, e.g. {errors[0]}", err=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    _report(result, as_json=False, engine_here=False)  # the server's CPU and kernels are its own
