"""Single-stream decode of fw's quantized paths against its own bf16, each engine in a process of its own.

The engines of one checkpoint: bf16 as stored, FP8 W8A16 and INT8 W8A8 quantized at load (``--quant fp8``,
``--quant int8`` with ``activations=dynamic``), and a 4-bit GPTQ copy (group 128, written once next to the
checkpoint by ``fw_quant_gptq.testing``) run with int8 activations. Each round starts one process per engine, in
turns (the order reversed every other round); a process builds its engine, decodes twice to warm up, then reports
the median of four timings of 64 greedy tokens after a 128-token prompt. A process of its own, because engines
built one after another in one process did not run alike: on an AMX Xeon VM the same bf16 model ran 26.9 tok/s
built first and 29.2 built second (benchmarks/RESULTS.md, session 33).

    python benchmarks/quant_decode.py --model /tmp/qwen05b --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ENGINES = {
    "bf16": {},
    "fp8": {"quant": "fp8"},
    "int8-w8a8": {"quant": "int8", "plugin_options": {"quant": {"activations": "dynamic"}}},
    "gptq-a8": {"plugin_options": {"quant": {"activations": "int8"}}},  # on the GPTQ copy
}

CHILD = r"""
import json, statistics, sys, time, torch
from fw import LLM, SamplingParams
llm = LLM(**json.loads(sys.argv[1]))
prompt = [{"prompt_token_ids": torch.randint(100, 20000, (128,), generator=torch.Generator().manual_seed(0)).tolist()}]
def rate():
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    more = SamplingParams(max_tokens=65, temperature=0, ignore_eos=True)
    t = time.perf_counter(); llm.generate(prompt, first, use_tqdm=False); one = time.perf_counter() - t
    t = time.perf_counter(); llm.generate(prompt, more, use_tqdm=False); all_ = time.perf_counter() - t
    return 64 / (all_ - one)
rate(); rate()
print(statistics.median(rate() for _ in range(4)))
"""


def gptq_copy(model: Path) -> Path:
    out = model.with_name(model.name + "-gptq4-g128")
    if not (out / "config.json").exists():
        from fw_quant_gptq.testing import write_checkpoint

        write_checkpoint(model, out, bits=4, group=128)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="A bf16 checkpoint directory (config.json + safetensors).")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--engines", default=",".join(ENGINES), help=f"Comma-separated, of: {', '.join(ENGINES)}.")
    args = p.parse_args()
    names = args.engines.split(",")
    if unknown := [n for n in names if n not in ENGINES]:
        p.error(f"--engines: unknown {', '.join(unknown)}; valid: {', '.join(ENGINES)}")
    model = Path(args.model)
    rates: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            path = gptq_copy(model) if name == "gptq-a8" else model
            kwargs = json.dumps({"model": str(path), **ENGINES[name]})
            done = subprocess.run([sys.executable, "-c", CHILD, kwargs], capture_output=True, text=True, check=True)
            rates[name].append(float(done.stdout.strip().splitlines()[-1]))
    base = statistics.median(rates["bf16"]) if "bf16" in rates else None
    for name, values in rates.items():
        median = statistics.median(values)
        ratio = f"  {median / base:.2f}x bf16" if base else ""
        print(f"{name:10s} {median:6.1f} tok/s  runs {' '.join(f'{v:.1f}' for v in values)}{ratio}")
    print(json.dumps({"rates": rates}))


if __name__ == "__main__":
    main()
