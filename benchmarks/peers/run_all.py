"""fw and its peers on one model and workload, one engine at a time; prints a markdown table.

    python benchmarks/peers/run_all.py --model /tmp/qwen05b                     # fw, transformers, vLLM, llama.cpp
    python benchmarks/peers/run_all.py --gguf smollm2.Q4_1.gguf                 # fw vs llama.cpp on a GGUF file
    python benchmarks/peers/run_all.py --gguf F --fw-option quant.activations=int8  # and fw with that option too
    python benchmarks/peers/run_all.py --gguf F --fw-dtype bfloat16                 # and fw in bf16 too

Each peer script installs its engine on first use (see setup.sh). Run it on a quiet machine: every engine
gets two threads, and anything else running skews the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = ["transformers", "vllm", "llamacpp"]
METRICS = [  # key, column title, whether higher is better
    ("ttft_ms", "TTFT ms", False),
    ("decode_tokens_per_s", "decode tok/s (1 stream)", True),
    ("output_tokens_per_s", "output tok/s ({n} requests)", True),
]


def run(cmd: list[str], env: dict | None = None, whole: bool = False) -> dict:
    """Run one engine and parse its JSON: all of stdout (`fw bench`) or, from a peer script, its last line
    (libraries log to stdout before it)."""
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    if proc.returncode:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}")
    return json.loads(proc.stdout if whole else proc.stdout.strip().splitlines()[-1])


def run_fw(args: argparse.Namespace, model: str, flags: list[str] | None = None) -> dict:
    """fw's row: as a user gets it, or with extra flags (one ``--plugin-option``, or ``--dtype``)."""
    fw = shutil.which("fw", path=str(Path(sys.executable).parent)) or shutil.which("fw") or "fw"
    common = [fw, "bench"]
    shape = [
        *(flags or []),
        "--model",
        model,
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--num-iters",
        str(args.repeats),
        "--json",
    ]
    env = {"OMP_NUM_THREADS": "2"}  # torch's default is every core; the peers get two
    lat = run([*common, "latency", *shape], env, whole=True)
    thr = run([*common, "throughput", *shape, "--num-prompts", str(args.num_prompts)], env, whole=True)
    version = subprocess.run([fw, "--version"], capture_output=True, text=True).stdout.strip()
    return {
        "engine": " ".join(["fw", *(flags or [])[1::2]]),
        "versions": {"fw": version},
        "ttft_ms_median": lat["ttft_ms_median"],
        "ttft_ms_spread": lat["ttft_ms_spread"],
        "decode_tokens_per_s_median": lat["decode_tokens_per_s_median"],
        "decode_tokens_per_s_spread": lat["decode_tokens_per_s_spread"],
        "output_tokens_per_s_median": thr["output_tokens_per_s_median"],
        "output_tokens_per_s_spread": thr["output_tokens_per_s_spread"],
        "latency": lat,
        "throughput": thr,
    }


def cpu() -> dict:
    """What the numbers depend on: the CPU's name, family and model (the name alone can hide a generation: "AMD
    EPYC" is Zen 3 as well as Zen 4), its vector and matrix extensions, and how many CPUs the machine has."""
    info: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        name, _, value = (part.strip() for part in line.partition(":"))
        if name in ("model name", "cpu family", "model", "flags") and name not in info:
            info[name] = value
    from fw.sdk.kernels import relevant_flags  # the flags fw's kernel choice depends on

    return {"model_name": info.get("model name", ""), "family": info.get("cpu family", ""),
            "model": info.get("model", ""), "flags": relevant_flags(" ".join(sorted(info.get("flags", "").split()))),
            "cpus": os.cpu_count()}


def heading(machine: dict) -> str:
    return (f"{machine['model_name']} (family {machine['family']} model {machine['model']}), "
            f"{machine['cpus']} CPUs, flags: `{machine['flags'] or 'no vector extensions'}`")


def table(results: list[dict], num_prompts: int) -> str:
    us = results[0]
    titles = [t.format(n=num_prompts) for _, t, _ in METRICS]
    head = ["engine", *(f"{t} median (spread)" for t in titles), *(f"fw/peer {t}" for t in titles)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['engine']} | failed: {r['error']} |")
            continue
        cells = [r["engine"]]
        cells += [f"{r[k + '_median']:.1f} ({r[k + '_spread']:.1f})" for k, _, _ in METRICS]
        cells += ["" if r is us else f"{us[k + '_median'] / r[k + '_median']:.2f}" for k, _, _ in METRICS]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Ratios fw/peer: below 1 is better for TTFT, above 1 for the token rates. Spread: max - min.")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="Checkpoint directory (see make_model.py).")
    source.add_argument("--gguf", help="A GGUF file: fw (--model FILE) against llama.cpp only.")
    p.add_argument("--peers", default=",".join(PEERS), help=f"Comma-separated subset of {','.join(PEERS)}.")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--fw-option", action="append", default=[], metavar="KIND.OPTION=VALUE",
                   help="Also run fw with this --plugin-option, as a row of its own (repeatable).")
    p.add_argument("--fw-dtype", action="append", default=[], metavar="DTYPE",
                   help="Also run fw with this --dtype, as a row of its own (repeatable).")
    p.add_argument("--out", default="peer_results.json", help="Where to write every engine's JSON.")
    args = p.parse_args()
    peers = ["llamacpp"] if args.gguf else [x for x in args.peers.split(",") if x]
    unknown = set(peers) - set(PEERS)
    if unknown:
        p.error(f"unknown peers: {', '.join(sorted(unknown))}")

    variants = [[], *(["--plugin-option", o] for o in args.fw_option), *(["--dtype", d] for d in args.fw_dtype)]
    results = [run_fw(args, args.gguf or args.model, flags) for flags in variants]
    shape = [
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--repeats",
        str(args.repeats),
    ]
    for peer in peers:
        source = ["--gguf", args.gguf] if args.gguf else ["--model", args.model]
        try:
            results.append(run([sys.executable, str(HERE / f"{peer}_peer.py"), *source, *shape]))
        except (RuntimeError, json.JSONDecodeError, IndexError) as exc:
            results.append({"engine": peer, "error": str(exc)})
    machine = cpu()
    Path(args.out).write_text(json.dumps({"cpu": machine, "results": results}, indent=2))
    print(f"CPU: {heading(machine)}\n")
    print(table(results, args.num_prompts))
    print(f"\nAll numbers: {args.out}")


if __name__ == "__main__":
    main()
