"""Speculative decoding on a workload whose outputs copy the prompt: single-stream decode tokens/s with and without
each proposer, acceptance rates, and the batch size above which speculation stops paying.

    python benchmarks/spec_decode.py [--model PATH] [--max-tokens 160] [--batch-sizes 1,2,4,8,16]

The default model is the embedded one (``fw serve``'s). Prompts are chat requests to repeat or lightly edit a text
given in the prompt (summarization and code editing copy most of their input), decoded greedily: with speculation the
outputs must be the same tokens, which the script checks, so the timings compare the same work. ``draft_model`` runs
the model as its own draft: every draft is accepted, so its rate is the verification overhead's ceiling.
Measures, never asserts; run it on a quiet machine (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from fw import LLM, SamplingParams, plugins
from fw.sdk import kernels

TEXTS = [
    "The city council met on Tuesday evening to discuss the new bicycle lanes on Main Street. After two hours of "
    "debate, the members voted seven to two to extend the lanes from the station to the river, starting next "
    "spring. The mayor said the change would make the centre safer for the children who cycle to school, and that "
    "the shops on Main Street would gain customers rather than lose them. Two shop owners spoke against the plan: "
    "they fear that deliveries will be harder once the parking spaces in front of their shops are gone. The "
    "council promised to keep two loading bays on each block and to review the lanes after one year.",
    "def total_price(items, tax_rate, discount=None):\n    subtotal = 0\n    for item in items:\n"
    "        if item.quantity <= 0:\n            raise ValueError(f'bad quantity for {item.name}')\n"
    "        subtotal += item.price * item.quantity\n    if discount is not None:\n"
    "        subtotal -= subtotal * discount\n    tax = subtotal * tax_rate\n    return round(subtotal + tax, 2)\n\n\n"
    "def cheapest(items):\n    best = None\n    for item in items:\n"
    "        if best is None or item.price < best.price:\n            best = item\n    return best\n",
    "Our library opens at nine in the morning and closes at six in the evening from Monday to Friday. On Saturdays "
    "it opens at ten and closes at four. It is closed on Sundays and on public holidays. Members may borrow up to "
    "ten books at a time for three weeks, and may renew them twice online or at the desk, unless another member "
    "has reserved them. Children's books can be borrowed for six weeks. The reading room on the first floor is "
    "reserved for quiet study, and the meeting rooms can be booked free of charge by local groups.",
    "class Counter:\n    def __init__(self, start=0, step=1):\n        self.start = start\n        self.step = step\n"
    "        self.count = start\n\n    def increment(self):\n        self.count += self.step\n        return self.count\n\n"
    "    def decrement(self):\n        self.count -= self.step\n        return self.count\n\n"
    "    def reset(self):\n        self.count = self.start\n\n    def __repr__(self):\n"
    "        return f'Counter(count={self.count}, step={self.step})'\n",
]
ASKS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Rewrite the following, changing nothing but fixing any typo:\n\n{}",
]


def prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": ASKS[i // len(TEXTS) % len(ASKS)].format(TEXTS[i % len(TEXTS)])}]
            for i in range(n)]


def token_ids(llm: LLM, conversations: list[list[dict]]) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    return [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in conversations]


def run(llm: LLM, batch: list[list[int]], max_tokens: int) -> dict:
    """The batch at once, greedy: per request its tokens and the seconds from its first token to its last."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in batch]
    first, last, tokens = {}, {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            if out.outputs[0].token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    wall = time.perf_counter() - start
    return {"tokens": [tokens[i] for i in ids], "wall": wall,
            "decode_s": [last[i] - first[i] for i in ids]}


def measure(model: str, spec: dict | None, conversations: list[list[dict]], num_singles: int, sizes: list[int],
            max_tokens: int, repeats: int) -> dict:
    """One engine: each of the first ``num_singles`` prompts alone (decode tokens/s after its first token, median
    of ``repeats``), then the first ``size`` prompts at once for each size, twice (output tokens/s over the wall time of the second)."""
    llm = LLM(model, speculative_config=spec, enable_prefix_caching=False)
    prompts = token_ids(llm, conversations)
    singles = prompts[:num_singles]
    run(llm, singles[:1], 16)  # warm-up: kernel choice, captured steps
    tokens, rates = [], []
    for prompt in singles:
        runs = [run(llm, [prompt], max_tokens) for _ in range(repeats)]
        tokens.append(runs[0]["tokens"][0])
        rates.append(statistics.median((len(r["tokens"][0]) - 1) / r["decode_s"][0] for r in runs))
    stats = llm.llm_engine.stats().spec_decode
    result = {"tokens": tokens, "decode_tokens_per_s": statistics.median(rates),
              "acceptance_rate": stats.acceptance_rate if stats is not None else None, "batched": {}}
    for size in sizes:
        run(llm, prompts[:size], max_tokens)  # a server's steady state: its shapes' kernels chosen, steps captured
        r = run(llm, prompts[:size], max_tokens)
        result["batched"][size] = sum(len(t) for t in r["tokens"]) / r["wall"]
    llm.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--batch-sizes", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    model = args.model or plugins.get_plugin_manager().hook.fw_default_model()
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    k = args.num_speculative_tokens
    conversations = prompts(max(sizes + [len(TEXTS) * len(ASKS)]))
    configs = {
        "off": None,
        f"ngram k={k}": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 5,
                         "prompt_lookup_min": 3},
        f"draft_model (itself) k={k}": {"model": model, "num_speculative_tokens": k},
    }
    info = kernels.machine()
    report = {"cpu": info["cpu"], "cpu_flags": kernels.relevant_flags(info["flags"]), "model": model,
              "max_tokens": args.max_tokens, "single_stream": {}, "batched_tokens_per_s": {}}
    reference = None
    for name, spec in configs.items():
        batched = [] if name.startswith("draft_model") else sizes  # the self-draft shows the ceiling only
        result = measure(model, spec, conversations, len(TEXTS) * len(ASKS), batched, args.max_tokens, args.repeats)
        reference = reference or result["tokens"]
        report["single_stream"][name] = {
            "decode_tokens_per_s": result["decode_tokens_per_s"],
            "acceptance_rate": result["acceptance_rate"],
            "same_tokens_as_off": result["tokens"] == reference,
            "mean_output_tokens": statistics.mean(len(t) for t in result["tokens"]),
        }
        if batched:
            report["batched_tokens_per_s"][name] = result["batched"]
        print(name, json.dumps(report["single_stream"][name]), json.dumps(result["batched"]), flush=True)
    off, on = report["batched_tokens_per_s"]["off"], report["batched_tokens_per_s"][f"ngram k={k}"]
    report["batched_speedup"] = {s: on[s] / off[s] for s in sizes}
    print(json.dumps(report, indent=2, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)


if __name__ == "__main__":
    main()
