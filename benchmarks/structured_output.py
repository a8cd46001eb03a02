"""Output tokens/s of 32 concurrent requests: unconstrained vs JSON-schema constrained (outlines sampler).

Two random-weight models: the tiny Llama of the tests (vocabulary 512) and a larger Qwen2-shaped one with a
32k byte-level BPE vocabulary trained here on the Python standard library's sources, since the mask's cost
grows with the vocabulary. Each configuration runs ``--repeats`` times after a warm-up that also compiles the
schema (its time is reported apart); the best run counts. Random weights mean the constraint alone shapes the
JSON, so constrained requests end when their object is complete and unconstrained ones run to max_tokens.
This machine's timings are noisy: the per-step sampler times are the steadier measure of the mask's cost.

    python benchmarks/structured_output.py [--batch 32] [--max-tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "active"],
}


def qwen2_32k(path: Path) -> Path:
    """A Qwen2-shaped model (hidden 256, 4 layers) whose tokenizer has 32,000 byte-level BPE tokens."""
    from fw.testing.models import make_tiny_model, train_byte_level_bpe

    make_tiny_model(
        "Qwen2ForCausalLM",
        path,
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:600]
    tokenizer = train_byte_level_bpe((p.read_text(errors="ignore") for p in sources), 32000)
    tokenizer.save(str(path / "tokenizer.json"))  # the same special tokens, so tokenizer_config.json still fits
    return path


def timed(llm, method: str) -> list[float]:
    """Record the seconds each call of the engine's ``sampler.<method>`` takes."""
    sampler = llm.llm_engine.sampler
    inner, spent = getattr(sampler, method), []

    def wrapper(*args):
        start = time.perf_counter()
        out = inner(*args)
        spent.append(time.perf_counter() - start)
        return out

    setattr(sampler, method, wrapper)
    return spent


def run(name: str, path: Path, args: argparse.Namespace) -> list[tuple]:
    from fw import LLM, SamplingParams

    free = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, ignore_eos=True) for i in range(args.batch)
    ]
    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, structured_outputs={"json": SCHEMA})
        for i in range(args.batch)
    ]
    configs = [
        ("default", free, "unconstrained"),
        ("outlines", free, "unconstrained"),
        ("outlines", constrained, "JSON schema"),
    ]
    runs = []
    for sampler, params, _ in configs:
        llm = LLM(path, sampler=sampler, num_kv_blocks=1024, max_model_len=512)
        start = time.perf_counter()
        llm.generate("x", params[0])
        warmup = time.perf_counter() - start  # includes compiling the schema for the constrained case
        runs.append(
            (llm, params, warmup, timed(llm, "sample"), timed(llm, "constrain") if sampler == "outlines" else [])
        )
    best = [0.0] * len(configs)
    mean_tokens = [0.0] * len(configs)
    # Interleaved repeats, best of each: other load on the machine hits every configuration alike.
    for _ in range(args.repeats):
        for i, (llm, params, *_rest) in enumerate(runs):
            start = time.perf_counter()
            outputs = llm.generate(["Output:"] * len(params), params)
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            best[i] = max(best[i], tokens / (time.perf_counter() - start))
            mean_tokens[i] = tokens / len(outputs)
    rows = []
    for (sampler, _, label), (llm, _, warmup, sample_s, constrain_s), rate, mean in zip(
        configs, runs, best, mean_tokens, strict=True
    ):
        per_step = [statistics.median(s) * 1e3 if s else 0.0 for s in (sample_s, constrain_s)]
        rows.append((name, sampler, label, rate, mean, *per_step, warmup))
        llm.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny-only", action="store_true", help="skip the 32k-vocabulary model")
    args = parser.parse_args()

    import torch

    from fw.testing.models import make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows += run("tiny llama, V=512", make_tiny_model("LlamaForCausalLM", Path(tmp) / "tiny"), args)
        if not args.tiny_only:
            rows += run("qwen2-shaped, V=32k", qwen2_32k(Path(tmp) / "qwen2"), args)
    print(
        f"\nbatch {args.batch}, max_tokens {args.max_tokens}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; schema: {json.dumps(SCHEMA)}\n"
    )
    print(
        f"{'model':<20} {'sampler':<9} {'requests':<14} {'out tok/s':>10} {'tokens/req':>11} "
        f"{'sample ms':>10} {'constrain ms':>13} {'warm-up s':>10}"
    )
    for model, sampler, label, rate, mean, sample_ms, constrain_ms, warmup in rows:
        print(
            f"{model:<20} {sampler:<9} {label:<14} {rate:>10.1f} {mean:>11.1f} "
            f"{sample_ms:>10.2f} {constrain_ms:>13.2f} {warmup:>10.2f}"
        )
    print("\nsample/constrain ms: median per engine step (constrain is the mask, inside sample).")


if __name__ == "__main__":
    main()
