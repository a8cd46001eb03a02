"""TTFT of a prompt whose long shared prefix comes back from the offload connector's RAM or disk tier, against
computing it (issue 19's offload benchmark).

    python benchmarks/offload_ttft.py MODEL [--prefix 2000]

The primary prefix cache is off, so every prefix hit is the connector's: request A computes the prefix (and the
connector keeps it), request B with the same prefix and another tail loads it. Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from fw import LLM, SamplingParams
from fw.sdk.kernels import machine, relevant_flags


def ttft(llm: LLM, tokens: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--prefix", type=int, default=2000)
    args = parser.parse_args()
    prefix = [(i * 7919) % 5000 + 10 for i in range(args.prefix)]
    info = machine()
    print(f"cpu: {info['cpu']} | flags: {relevant_flags(info['flags'])} | prefix {args.prefix} tokens")
    for tier, options in (("ram", {"cpu_bytes": 1 << 30}), ("disk", {"cpu_bytes": 0})):
        with tempfile.TemporaryDirectory() as path:
            llm = LLM(args.model, enable_prefix_caching=False, max_model_len=args.prefix + 64, kv_connector="offload",
                      plugin_options={"kv_connector": {"path": path, **options}})
            computed = ttft(llm, prefix + [11, 12, 13])
            loaded = ttft(llm, prefix + [21, 22, 23])
            hits = llm.llm_engine.stats().kv_connector.hits
            print(f"{tier}: TTFT computing the prefix {computed * 1000:.0f} ms, loading it {loaded * 1000:.0f} ms "
                  f"({computed / loaded:.1f}x; {hits} tokens loaded)")
            llm.shutdown()
            del llm


if __name__ == "__main__":
    main()
