"""llama.cpp (llama-cpp-python's C API) on fw bench's workload; prints one JSON line.

    python benchmarks/peers/llamacpp_peer.py --model DIR     # converts DIR to a bf16 GGUF once, then runs it
    python benchmarks/peers/llamacpp_peer.py --model DIR --outtype q8_0   # ... or to Q8_0 (fw's 8-bit paths)
    python benchmarks/peers/llamacpp_peer.py --model DIR --outtype q4_0   # ... or to Q4_0 (4-bit GPTQ/AWQ)
    python benchmarks/peers/llamacpp_peer.py --model DIR --outtype q4_k_m # ... or to Q4_K_M (then run_all.py --gguf it)
    python benchmarks/peers/llamacpp_peer.py --model DIR --outtype q5_k_m # ... or to Q5_K_M
    python benchmarks/peers/llamacpp_peer.py --gguf FILE     # runs an existing GGUF (e.g. a Q4_1 one)

The high-level `Llama` class decodes one sequence at a time, so the 32-request part drives llama_batch
directly: every sequence has its own seq id in one context, and each step decodes one token of each.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import common

# The converter names a BPE pre-tokenizer by hashing its output on a test text and refuses hashes it does not
# know, such as make_model.py's tokenizer's. That one splits as GPT-2 does (byte-level BPE with GPT-2's regex),
# so an unknown hash is written as GPT-2's; tokenizers the converter knows keep their names.
CONVERT = """
import runpy, sys
vendor, sys.argv = sys.argv[1], [sys.argv[1] + "/convert_hf_to_gguf.py", *sys.argv[2:]]
sys.path.insert(0, vendor)
from conversion.base import TextModel
known = TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
TextModel.get_vocab_base_pre = pre
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(model: Path, outtype: str = "bf16") -> Path:
    """A GGUF of a safetensors checkpoint (bf16, or the converter's q8_0), by the converter vendored in the
    llama-cpp-python sdist."""
    out = common.PEERS_DIR / "gguf" / f"{model.resolve().name}-{outtype}.gguf"
    newest = max(f.stat().st_mtime for f in model.iterdir())
    if out.exists() and out.stat().st_mtime > newest:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    (vendor,) = (common.PEERS_DIR / "llamacpp" / "src").glob("llama_cpp_python-*/vendor/llama.cpp")
    tmp = out.with_suffix(".part")  # an interrupted conversion must not pass for a finished one
    cmd = [sys.executable, "-c", CONVERT, str(vendor), str(model), "--outtype", outtype, "--outfile", str(tmp)]
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    tmp.rename(out)
    return out


def quantize(ll, source: Path, ftype: int, name: str) -> Path:
    """``source`` quantized by llama.cpp's quantizer (llama-quantize's defaults: every matrix, the output too)."""
    out = source.with_name(source.name.replace("-bf16", f"-{name}"))
    if out.exists() and out.stat().st_mtime > source.stat().st_mtime:
        return out
    params = ll.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, common.THREADS
    tmp = out.with_suffix(".part")
    assert ll.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params)) == 0, "quantize failed"
    tmp.rename(out)
    return out


# The types llama.cpp's quantizer writes from the bf16 file, and its file types for them.
QUANTIZED = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M"}


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--gguf", help="An existing GGUF file to run instead of converting --model.")
    p.add_argument("--outtype", default="bf16", choices=("bf16", "q8_0", *QUANTIZED),
                   help="What --model converts to: bf16 (the peer comparison), q8_0 (against fw's 8-bit paths), "
                   "q4_0 (against 4-bit GPTQ/AWQ: the bf16 file quantized by llama.cpp's own quantizer), q4_k_m "
                   "(llama.cpp's most used mix of Q4_K and Q6_K; Q5_0 and Q8_0 instead where rows are not whole K-quant "
                   "blocks) or q5_k_m (Q5_K and Q6_K).")
    args = p.parse_args()
    if not (args.model or args.gguf):
        p.error("give --model DIR or --gguf FILE")
    common.enter_venv("llamacpp")
    import llama_cpp as ll

    if args.gguf:
        gguf = Path(args.gguf)
    elif args.outtype in QUANTIZED:
        ftype = getattr(ll, QUANTIZED[args.outtype])
        gguf = quantize(ll, convert(Path(args.model)), ftype, args.outtype)
    else:
        gguf = convert(Path(args.model), args.outtype)
    args.model = str(gguf)

    # llama-cpp-python routes llama.cpp's log here; its info level prints every graph built, several per step.
    logging.getLogger("llama-cpp-python").setLevel(logging.WARNING)
    ll.llama_backend_init()
    model_params = ll.llama_model_default_params()
    # FW_LLAMACPP_EXTRA_BUFTS=0: no extra buffer types (weight repacking, the AMX buffer). On an AMX Xeon VM (session
    # 17) llama.cpp 0.3.36 segfaults in ggml_backend_amx_mul_mat on its first product; without them it runs.
    model_params.use_extra_bufts = os.environ.get("FW_LLAMACPP_EXTRA_BUFTS", "1") != "0"
    model = ll.llama_model_load_from_file(str(gguf).encode(), model_params)
    vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    sampler = ll.llama_sampler_init_greedy()  # stateless: one serves every sequence

    def context(n_seq: int):
        params = ll.llama_context_default_params()
        # Each sequence gets n_ctx / n_seq_max cells of its own (the KV cache is not unified by default).
        params.n_ctx = n_seq * (args.input_len + args.output_len)
        params.n_batch = n_seq * args.input_len  # every prompt in one llama_decode call
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = common.THREADS
        ctx = ll.llama_init_from_model(model, params)
        assert ctx, "llama_init_from_model failed"
        return ctx, ll.llama_batch_init(params.n_batch, 0, 1)

    def generate(ctx, batch, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
        """Greedy continuations of all prompts at once; returns the first and last token's times."""
        ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
        tokens = [(seq, pos, tok) for seq, prompt in enumerate(prompts) for pos, tok in enumerate(prompt)]
        last = {seq: i for i, (seq, _, _) in enumerate(tokens)}  # the prompt position that samples
        first = None
        for step in range(output_len):
            batch.n_tokens = len(tokens)
            for i, (seq, pos, tok) in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = last.get(seq) == i
            assert ll.llama_decode(ctx, batch) == 0, "llama_decode failed"
            pos = len(prompts[0]) + step
            tokens = [(seq, pos, ll.llama_sampler_sample(sampler, ctx, last[seq])) for seq in range(len(prompts))]
            last = {seq: seq for seq in range(len(prompts))}
            first = first or time.perf_counter()
        return first, time.perf_counter()

    single_ctx, single_batch = context(1)
    many_ctx, many_batch = context(args.num_prompts)
    result = common.run_workload(
        args,
        vocab,
        lambda prompt, n: generate(single_ctx, single_batch, [prompt], n),
        lambda prompts, n: generate(many_ctx, many_batch, prompts, n),
    )
    desc = ctypes.create_string_buffer(256)
    ll.llama_model_desc(model, desc, len(desc))
    common.emit("llama.cpp", args, {"llama_cpp_python": ll.__version__, "model": desc.value.decode()}, result)


if __name__ == "__main__":
    main()
