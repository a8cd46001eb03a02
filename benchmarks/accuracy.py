"""Numerics of every fw execution path against a float32 reference: greedy agreement and first-token KL.

    python benchmarks/accuracy.py                            # the embedded default (SmolLM2 Q4_1 GGUF)
    python benchmarks/accuracy.py --random-model /tmp/acc-qwen2  # also a random bf16 Qwen2 (built if missing)
    python benchmarks/accuracy.py --random-model /tmp/acc-qwen2 --quant fp8 --quant int8 --quant int8:dynamic
    python benchmarks/accuracy.py --random-model /tmp/acc-qwen2 --quant int8:dynamic,layers=lm_head  # int8 head only

For each model, 56 fixed chat prompts are rendered with the model's chat template, then greedily continued
for 32 tokens (end-of-sequence ignored, so every path is compared on all 32) by:

- the reference: transformers in float32 on the same prompt ids (for a GGUF file, transformers dequantizes
  it to float32 itself: an implementation we did not write);
- fw on each path: dtype bfloat16 and float32, native kernels on and off (``FW_NATIVE``), each in its own
  process because the choice is made once per process;
- with ``--quant NAME[:ACTIVATIONS][,OPTION=VALUE...]``, fw in bf16 with that quant plugin quantizing the random
  model at load (``quant.activations`` = ACTIVATIONS, e.g. ``int8:dynamic`` for W8A8; other plugin options
  after commas, e.g. ``fp8,lm_head=true`` for an FP8 head too, ``int8:dynamic,layers=lm_head`` for an int8 head
  on an otherwise bf16 model; ``gptq`` for the random model rounded to 4 bits in groups of 128 ahead, beside it
  as ``<model>-gptq``, e.g. ``gptq:int8,lm_head=true,lm_head_bits=4``);
- llama.cpp on the same GGUF file, where ``peers/setup.sh llamacpp`` has installed it (not installed here
  by this script: it builds for 10-15 minutes).

Reported per path: first-token agreement with the reference, the mean common greedy prefix (of 32), the
share of fully identical continuations, and the mean KL(reference || path) of the first-token distribution.
Random weights give flat distributions full of near-ties, so their agreement is a harsher test than a real
model's. Nothing here asserts; tests/test_logits.py holds the assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OUTPUT_LEN = 32
PROMPTS = [
    "What is the capital of France?", "Name three primary colors.", "How many legs does a spider have?",
    "What is 12 times 12?", "Who wrote Romeo and Juliet?", "What is the boiling point of water in Celsius?",
    "Translate 'good morning' into Spanish.", "What is the largest planet in the solar system?",
    "Give me a synonym for happy.", "What language is spoken in Brazil?", "What is photosynthesis?",
    "Write a haiku about the sea.", "What is the square root of 81?", "Which ocean is the largest?",
    "What does CPU stand for?", "Name a mammal that can fly.", "What is the chemical symbol for gold?",
    "How many days are in a leap year?", "What is the tallest mountain on Earth?", "Who painted the Mona Lisa?",
    "What is the opposite of cold?", "Explain gravity in one sentence.", "What is the capital of Japan?",
    "How many continents are there?", "What color is the sky on a clear day?", "What is the freezing point of water?",
    "Name a programming language.", "What is the currency of the United Kingdom?", "What do bees make?",
    "What is the speed of light, roughly?", "Who was the first person on the Moon?", "What is an atom?",
    "Write one sentence about autumn.", "What is the capital of Italy?", "How many hours are in a day?",
    "What is the main gas in the air we breathe?", "Name a fruit that is yellow.", "What is 7 plus 8?",
    "What instrument has 88 keys?", "What is the longest river in Africa?", "Define the word 'gigantic'.",
    "What is the capital of Germany?", "Which animal is known as the king of the jungle?", "What is H2O?",
    "How many sides does a hexagon have?", "What is the smallest prime number?", "Name a famous scientist.",
    "What season comes after winter?", "Which planet is called the Red Planet?", "What is a noun?",
    "Suggest a name for a cat.", "What is the capital of Canada?", "How do you say 'thank you' in French?",
    "What is the largest desert in the world?", "Give an example of a renewable energy source.",
    "What is the sum of the angles in a triangle?",
]
# Paths as (label, dtype, FW_NATIVE).
PATHS = [("bf16, native", "bfloat16", "1"), ("bf16, torch", "bfloat16", "0"),
         ("fp32, native", "float32", "1"), ("fp32, torch", "float32", "0")]


def fw_worker(model: str | None, dtype: str, quant: str | None, out: Path) -> None:
    """Greedy continuations and first-token log-probabilities of every prompt, on this process's fw path."""
    from fw import LLM, SamplingParams

    plugin, *settings = (quant or "auto").split(",")
    name, _, activations = plugin.partition(":")
    options = dict(setting.split("=", 1) for setting in settings) | ({"activations": activations} if activations else {})
    options = {"quant": options} if options else {}
    if name == "gptq":  # the plugin reads checkpoints quantized ahead: the random model's, 4-bit in groups of 128
        from fw_quant_gptq.testing import write_checkpoint

        gptq = Path(f"{model}-gptq")
        model = str(gptq if gptq.exists() else write_checkpoint(Path(model), gptq, group=128))
    llm = LLM(model, dtype=dtype, quant=name, plugin_options=options, max_model_len=1024, max_num_seqs=len(PROMPTS))
    engine = llm.llm_engine
    first: dict[str, torch.Tensor] = {}
    sample = engine.sampler.sample

    def recording(logits, batch):
        for row, (rid, done) in enumerate(zip(batch.request_ids, batch.output_token_ids, strict=True)):
            if not done:
                first[rid] = logits[row].log_softmax(-1).clone()
        return sample(logits, batch)

    engine.sampler.sample = recording
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)
    torch.save({
        "prompt_ids": [o.prompt_token_ids for o in outputs],
        "tokens": [o.outputs[0].token_ids for o in outputs],
        "first": torch.stack([first[o.request_id] for o in outputs]),
        "model": engine.config.model.model,
    }, out)
    llm.shutdown()


def reference_worker(model: str, prompt_ids: list[list[int]], out: Path) -> None:
    """transformers in float32, greedy with its KV cache, on the prompt ids fw rendered."""
    import transformers

    path = Path(model)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent if kwargs else path, dtype=torch.float32,
                                                           **kwargs).eval()
    tokens, first = [], []
    with torch.inference_mode():
        for ids in prompt_ids:
            step = hf(torch.tensor([ids]), use_cache=True)
            logits, seq = step.logits[0, -1], []
            first.append(logits.float().log_softmax(-1))
            for _ in range(OUTPUT_LEN):
                seq.append(int(logits.argmax()))
                step = hf(torch.tensor([[seq[-1]]]), cache=step.cache, use_cache=True)
                logits = step.logits[0, -1]
            tokens.append(seq)
    torch.save({"tokens": tokens, "first": torch.stack(first)}, out)


def llamacpp_worker(gguf: str, prompt_ids: list[list[int]], out: Path) -> None:
    """llama.cpp (llama-cpp-python's C API, in the peers' virtualenv) on the same prompt ids."""
    import llama_cpp as ll

    ll.llama_backend_init()
    model_params = ll.llama_model_default_params()
    # FW_LLAMACPP_EXTRA_BUFTS=0, as for peers/llamacpp_peer.py: without the AMX buffer, which segfaults on AMX VMs
    model_params.use_extra_bufts = os.environ.get("FW_LLAMACPP_EXTRA_BUFTS", "1") != "0"
    model = ll.llama_model_load_from_file(gguf.encode(), model_params)
    vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    params = ll.llama_context_default_params()
    params.n_ctx = params.n_batch = 1024
    params.n_threads = params.n_threads_batch = 2
    ctx = ll.llama_init_from_model(model, params)
    batch = ll.llama_batch_init(params.n_batch, 0, 1)
    tokens, first = [], []
    for ids in prompt_ids:
        ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
        seq, chunk, pos = [], list(ids), 0
        for _ in range(OUTPUT_LEN + 1):
            batch.n_tokens = len(chunk)
            for i, tok in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos + i, 1, i == len(chunk) - 1
                batch.seq_id[i][0] = 0
            assert ll.llama_decode(ctx, batch) == 0, "llama_decode failed"
            pos += len(chunk)
            logits = torch.tensor(ll.llama_get_logits_ith(ctx, -1)[:vocab])
            if not seq:
                first.append(logits.log_softmax(-1))
            if len(seq) == OUTPUT_LEN:
                break
            seq.append(int(logits.argmax()))
            chunk = [seq[-1]]
        tokens.append(seq)
    torch.save({"tokens": tokens, "first": torch.stack(first)}, out)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def compare(ref: dict, run: dict) -> dict[str, float]:
    n = len(ref["tokens"])
    prefixes = [_common_prefix(a, b) for a, b in zip(ref["tokens"], run["tokens"], strict=True)]
    p_ref = ref["first"].double()
    kl = (p_ref.exp() * (p_ref - run["first"].double())).sum(-1)
    return {
        "first_token_agreement": sum(p > 0 for p in prefixes) / n,
        "mean_common_prefix": sum(prefixes) / n,
        "identical": sum(p == OUTPUT_LEN for p in prefixes) / n,
        "mean_first_token_kl": float(kl.mean()),
    }


def _run(args: list[str], env: dict[str, str] | None = None, python: str = sys.executable) -> None:
    subprocess.run([python, __file__, *args], check=True, env={**os.environ, **(env or {})})


def evaluate(model: str | None, work: Path, quants: list[str]) -> dict[str, dict[str, float]]:
    runs = {}
    paths = [(*path, None) for path in PATHS] + [(f"bf16, --quant {q}", "bfloat16", "1", q) for q in quants]
    for i, (label, dtype, native, quant) in enumerate(paths):
        out = work / f"fw-{i}.pt"
        _run(["--worker", "fw", "--dtype", dtype, "--out", str(out), *(["--model", model] if model else []),
              *(["--quant", quant] if quant else [])], {"FW_NATIVE": native})
        runs[label] = torch.load(out)
    first = next(iter(runs.values()))
    model_path = first["model"]
    ids_file = work / "prompt_ids.json"
    ids_file.write_text(json.dumps(first["prompt_ids"]))
    _run(["--worker", "reference", "--model", model_path, "--prompt-ids", str(ids_file), "--out", str(work / "ref.pt")])
    ref = torch.load(work / "ref.pt")
    llamacpp = Path(os.environ.get("FW_PEERS_DIR", Path.home() / ".cache" / "fw-peers")) / "llamacpp/venv/bin/python"
    if model_path.endswith(".gguf") and llamacpp.exists():
        out = work / "llamacpp.pt"
        _run(["--worker", "llamacpp", "--model", model_path, "--prompt-ids", str(ids_file), "--out", str(out)],
             python=str(llamacpp))
        runs["llama.cpp (reference point)"] = torch.load(out)
    return {label: compare(ref, run) for label, run in runs.items()} | {"_model": model_path}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--random-model", help="Also a random bf16 checkpoint; a missing directory gets a Qwen2-shaped "
                   "one (hidden 512, 8 layers) from fw.testing.models, small enough for a float32 reference.")
    p.add_argument("--quant", action="append", default=[], metavar="NAME[:ACTIVATIONS][,OPTION=VALUE...]",
                   help="Also the random model quantized at load by this quant plugin (repeatable).")
    p.add_argument("--json", help="Write the results here as well.")
    p.add_argument("--worker", choices=["fw", "reference", "llamacpp"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker == "fw":
        return fw_worker(args.model, args.dtype, args.quant[0] if args.quant else None, Path(args.out))
    if args.worker:
        worker = reference_worker if args.worker == "reference" else llamacpp_worker
        return worker(args.model, json.loads(Path(args.prompt_ids).read_text()), Path(args.out))
    if args.random_model and not Path(args.random_model).exists():
        from fw.testing.models import make_tiny_model

        make_tiny_model("Qwen2ForCausalLM", args.random_model, dtype="bfloat16", hidden_size=512, intermediate_size=1408,
                        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                        max_position_embeddings=2048)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in [("embedded default", None), ("random bf16", args.random_model)]:
            if name == "embedded default" or model:
                work = Path(tmp) / name.replace(" ", "-")
                work.mkdir()
                results[name] = evaluate(model, work, args.quant if model else [])
    print(f"| model | path | first token = ref | mean common prefix (of {OUTPUT_LEN}) | identical | mean first-token KL |")
    print("|---|---|---|---|---|---|")
    for name, rows in results.items():
        for label, r in rows.items():
            if not label.startswith("_"):
                print(f"| {name} | {label} | {r['first_token_agreement']:.0%} | {r['mean_common_prefix']:.1f} | "
                      f"{r['identical']:.0%} | {r['mean_first_token_kl']:.2e} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
