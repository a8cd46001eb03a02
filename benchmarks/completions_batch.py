"""One /v1/completions request with a list of prompts against the same prompts sent one request at a time.

A list runs in one engine pass (all prompts admitted together, batched by the scheduler), so it should take
about as long as the slowest prompt, not the sum. Every prompt is distinct (no prefix-cache hits), greedy,
and generates exactly ``--max-tokens`` (EOS ignored). One warm-up, then ``--repeats`` timed rounds; medians.
Start the server first, e.g. ``fw serve ./my-model --disable-log-requests``, on a quiet machine.

    python benchmarks/completions_batch.py [--base-url http://127.0.0.1:8000/v1] [--num-prompts 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx


def complete(client: httpx.Client, url: str, model: str | None, prompt: str | list[str], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    resp = client.post(f"{url}/completions", json=body if model is None else {**body, "model": model})
    resp.raise_for_status()
    return resp.json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", help="Model name; default: the server's only model.")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    def prompts(round_: int) -> list[str]:
        return [f"Round {round_}, story {i}: once upon a time there was" for i in range(args.num_prompts)]

    with httpx.Client(timeout=None) as client:
        complete(client, args.base_url, args.model, prompts(-1), args.max_tokens)  # warm-up
        batched, sequential = [], []
        for r in range(args.repeats):
            start = time.perf_counter()
            complete(client, args.base_url, args.model, prompts(2 * r), args.max_tokens)
            batched.append(time.perf_counter() - start)
            start = time.perf_counter()
            for prompt in prompts(2 * r + 1):
                complete(client, args.base_url, args.model, prompt, args.max_tokens)
            sequential.append(time.perf_counter() - start)
    tokens = args.num_prompts * args.max_tokens
    result = {
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "list_request_s_median": statistics.median(batched),
        "sequential_requests_s_median": statistics.median(sequential),
        "speedup": statistics.median(sequential) / statistics.median(batched),
        "list_output_tokens_per_s": tokens / statistics.median(batched),
        "sequential_output_tokens_per_s": tokens / statistics.median(sequential),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
