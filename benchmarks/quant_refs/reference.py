"""Reference GPTQ/AWQ checkpoints and reference outputs, made with the real tools (GPTQModel).

Run with the reference virtualenv (see README.md beside this file), not with fw's own venv:

    python reference.py produce --plain DIR --out DIR --method gptq --bits 4 --group-size 32 --sym --no-desc-act
    python reference.py reference --model DIR --out DIR/reference.safetensors [--prompts-ids prompts.json]

``produce`` quantizes a plain (unquantized) checkpoint with GPTQModel and saves it in the standard
layout: GPTQ v1 (``checkpoint_format: "gptq"``) or AWQ GEMM (``zero_point: true`` unless --sym).

``reference`` loads a GPTQ/AWQ checkpoint with GPTQModel's plain-torch kernels on the CPU and writes:
  <module>.weight   float32 [out, in]: the module's weight as dequantized by GPTQModel's own code
  logprobs.<i>      float32 [T, V]: prefill log-softmax for every position of prompt i
  greedy.<i>        int64 [16]: greedy continuation of prompt i (argmax, EOS not treated specially)
  input_ids.<i>     int64 [T]: prompt i
The safetensors metadata says which kernels, dtypes and versions produced them.
"""

from __future__ import annotations

import os

# Offline, and small on a 2-core machine. Set before torch/transformers/gptqmodel are imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # GPTQModel's CPU pool; 1 worker stalls on 2 cores
os.environ.setdefault("OMP_NUM_THREADS", "2")
# GPTQModel wraps TorchLinear.dequantize_weight in torch.compile; on CPU that means an inductor/C++ build per
# shape (tens of seconds each). Dynamo off runs the same function eagerly. Export TORCHDYNAMO_DISABLE=0 to keep it.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

CALIBRATION_TEXTS = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.",
    "Once upon a time, there was a little robot who wanted to learn how to paint the sky at sunset.",
    "Large language models predict the next token given the previous tokens in the sequence.",
    "The inference engine schedules requests, allocates key-value cache blocks and samples tokens.",
    "Hello, world! How are you today? I am fine, thank you. What is the weather like in Paris?",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000 3.14159 2.71828 -1 +1 = != <= >=",
    "Le renard brun rapide saute par-dessus le chien paresseux. Bonjour tout le monde !",
]
DEFAULT_PROMPTS = ["The quick brown fox", "Hello, world! How"]
GREEDY_TOKENS = 16
TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
]


def _log(msg: str) -> None:
    print(f"[quant_refs] {msg}", file=sys.stderr, flush=True)


def _versions() -> dict:
    from importlib.metadata import version

    out = {}
    for pkg in ("gptqmodel", "torch", "transformers", "optimum", "safetensors"):
        try:
            out[pkg] = version(pkg)
        except Exception:  # noqa: BLE001 - informational only
            out[pkg] = None
    return out


def _torch_dtype(name: str):
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


# ---------------------------------------------------------------------------------------------- produce


def produce(args: argparse.Namespace) -> dict:
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.quantization.config import AWQConfig, GPTQConfig
    from transformers import AutoTokenizer

    torch.set_num_threads(2)
    plain, out = Path(args.plain).resolve(), Path(args.out).resolve()
    # GPTQModel's AWQ processor writes per-run logs into ./logs; keep them out of the caller's directory.
    scratch = tempfile.TemporaryDirectory(prefix="quant_refs_")
    os.chdir(scratch.name)
    timings = {}
    t0 = time.perf_counter()

    tokenizer = AutoTokenizer.from_pretrained(plain)
    calibration = []
    for text in CALIBRATION_TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        calibration.append({"input_ids": ids, "attention_mask": [1] * len(ids)})

    common = dict(
        bits=args.bits,
        group_size=args.group_size,
        sym=args.sym,
        desc_act=args.desc_act,
        true_sequential=args.true_sequential,
        lm_head=args.lm_head,
        # The default is a random temp dir, which would land in config.json and make it differ run to run.
        offload_to_disk=False,
    )
    if args.method == "gptq":
        # format "gptq" = v1 layout (zero points stored minus one).
        act_group_aware = args.act_group_aware
        if act_group_aware is None and (args.desc_act or args.group_size == -1):
            # GPTQModel turns act_group_aware on by default, but refuses it with desc_act and with group_size -1
            # ("`act_group_aware=True` requires `group_size > 0`, got `-1`").
            act_group_aware = False
        qcfg = GPTQConfig(format="gptq", act_group_aware=act_group_aware, **common)
        # The packer: TorchLinear (GPTQModel's default for GPTQ too), which writes v1 zero points.
        backend = BACKEND.GPTQ_TORCH
    else:
        if args.desc_act:
            raise SystemExit("AWQ has no desc_act")
        qcfg = AWQConfig(format="gemm", **common)
        # On a machine without CUDA the default AWQ packer (AwqGEMMLinear) is refused ("AWQ: CUDA is not
        # available."); AwqTorchLinear packs the same GEMM layout.
        backend = BACKEND.AWQ_TORCH
    _log(f"quantize config: {qcfg}")

    t = time.perf_counter()
    model = GPTQModel.load(str(plain), qcfg, device="cpu", dtype=_torch_dtype(args.dtype))
    timings["load_plain_s"] = time.perf_counter() - t

    t = time.perf_counter()
    model.quantize(calibration, batch_size=1, tokenizer=tokenizer, backend=backend)
    timings["quantize_s"] = time.perf_counter() - t

    t = time.perf_counter()
    if out.exists():
        shutil.rmtree(out)
    model.save(str(out))
    timings["save_s"] = time.perf_counter() - t

    # GPTQModel re-serialises the tokenizer (and splits out chat_template.jinja); put the plain model's own
    # tokenizer files back so the quantized checkpoint tokenizes exactly as the plain one.
    for name in TOKENIZER_FILES:
        (out / name).unlink(missing_ok=True)
    for name in TOKENIZER_FILES:
        if (plain / name).exists():
            shutil.copy2(plain / name, out / name)

    timings["total_s"] = time.perf_counter() - t0
    config = json.loads((out / "config.json").read_text())
    record = {
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "calibration_texts": CALIBRATION_TEXTS,
        "timings": timings,
        "versions": _versions(),
        "quantization_config": config.get("quantization_config"),
    }
    (out / "produce.json").write_text(json.dumps(record, indent=2) + "\n")
    _log(f"produced {out} in {timings['total_s']:.1f}s (quantize {timings['quantize_s']:.1f}s)")
    print(json.dumps({"out": str(out), "timings": timings}))
    return record


# -------------------------------------------------------------------------------------------- reference


def _checkpoint_tensors(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    tensors = {}
    for name in files:
        tensors.update(load_file(str(model_dir / name)))
    return tensors


def _dequantize(module) -> tuple:
    """(weight [in, out], name of the GPTQModel function used) for a loaded quantized linear."""
    import torch
    from gptqmodel.nn_modules.qlinear import PackableQuantLinear
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    with torch.no_grad():
        if isinstance(module, TorchLinear):
            # The class attribute, not the instance's torch.compile wrapper set by TorchLinear.optimize().
            weight = TorchLinear.dequantize_weight(module)
            # Its generic parent implementation must agree (a self-check of the reference).
            generic = PackableQuantLinear.dequantize_weight(module)
            if not torch.equal(weight, generic):
                raise AssertionError(f"TorchLinear fast and generic dequant differ for {module}")
            return weight, "gptqmodel.nn_modules.qlinear.torch.TorchLinear.dequantize_weight"
        if isinstance(module, AwqTorchLinear):
            # Exactly the call AwqTorchLinear.forward makes.
            weight = dequantize_gemm(
                qweight=module.qweight,
                qzeros=module.qzeros,
                scales=module.scales,
                bits=module.bits,
                group_size=module.group_size,
            )
            return weight, "gptqmodel.quantization.awq.utils.packing_utils.dequantize_gemm"
    raise TypeError(f"no reference dequantization for {type(module).__name__}")


def _prompt_ids(args, model_dir: Path) -> list:
    if args.prompts_ids:
        prompts = json.loads(Path(args.prompts_ids).read_text())
        if not (isinstance(prompts, list) and all(isinstance(p, list) and p for p in prompts)):
            raise SystemExit("--prompts-ids must hold a JSON list of non-empty lists of token ids")
        return [[int(t) for t in p] for p in prompts]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [tokenizer.encode(text, add_special_tokens=False).ids for text in DEFAULT_PROMPTS]


def reference(args: argparse.Namespace) -> dict:
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear
    from safetensors.torch import save_file

    torch.set_num_threads(2)
    model_dir = Path(args.model)
    qconfig = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    method = qconfig.get("quant_method") or qconfig.get("method")
    backend = {"gptq": BACKEND.GPTQ_TORCH, "awq": BACKEND.AWQ_TORCH}[method]
    timings = {}
    t0 = time.perf_counter()

    checkpoint = _checkpoint_tensors(model_dir)
    # GPTQModel's torch kernels accept only float16/bfloat16 at load time (SUPPORTS_DTYPES; float32 is refused
    # by kernel selection), so load in the checkpoint's own half type (lossless) and upcast afterwards.
    float_dtypes = {t.dtype for k, t in checkpoint.items() if t.is_floating_point() and not k.endswith(".scales")}
    load_dtype = torch.bfloat16 if float_dtypes == {torch.bfloat16} else torch.float16

    t = time.perf_counter()
    qmodel = GPTQModel.load(str(model_dir), backend=backend, device="cpu", dtype=load_dtype)
    timings["load_s"] = time.perf_counter() - t
    model = qmodel.model
    model.eval()

    compute_dtype = _torch_dtype(args.dtype)
    restored = 0
    if compute_dtype != load_dtype:
        model.to(compute_dtype)  # parameters and float buffers, scales included (fp16 -> fp32 is exact)
        # Any float32 tensor the half-precision load rounded is put back from the checkpoint as stored.
        quant_prefixes = tuple(n + "." for n, m in model.named_modules() if isinstance(m, BaseQuantLinear))
        with torch.no_grad():
            for name, tensor in list(model.state_dict().items()):
                source = checkpoint.get(name)
                if source is None or not source.is_floating_point() or name.startswith(quant_prefixes):
                    continue
                if source.dtype != load_dtype and source.shape == tensor.shape:
                    tensor.copy_(source.to(compute_dtype))
                    restored += 1

    # -- dequantized weights
    t = time.perf_counter()
    out = {}
    kernels, dequant_functions, missing_in_checkpoint = set(), set(), []
    for name, module in model.named_modules():
        if not isinstance(module, BaseQuantLinear):
            continue
        kernels.add(f"{type(module).__module__}.{type(module).__name__}")
        weight, function = _dequantize(module)
        dequant_functions.add(function)
        out[f"{name}.weight"] = weight.t().contiguous().to(torch.float32)
        if f"{name}.qweight" not in checkpoint:
            missing_in_checkpoint.append(name)
    timings["dequantize_s"] = time.perf_counter() - t
    if not out:
        raise SystemExit(f"no quantized modules found in {model_dir}")
    if missing_in_checkpoint:
        _log(f"WARNING: module names not in the checkpoint: {missing_in_checkpoint[:8]}")

    # -- prefill log-probs and greedy continuation
    t = time.perf_counter()
    prompts = _prompt_ids(args, model_dir)
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            input_ids = torch.tensor([ids], dtype=torch.long)
            logits = model(input_ids=input_ids, use_cache=False).logits[0]
            out[f"input_ids.{i}"] = input_ids[0].clone()
            out[f"logprobs.{i}"] = torch.log_softmax(logits.float(), dim=-1).contiguous()
            # Plain argmax with a full forward per step: no sampling, no EOS stop, no cache.
            seq = input_ids
            new = []
            for _ in range(GREEDY_TOKENS):
                next_id = model(input_ids=seq, use_cache=False).logits[0, -1].float().argmax()
                new.append(int(next_id))
                seq = torch.cat([seq, next_id.view(1, 1)], dim=1)
            out[f"greedy.{i}"] = torch.tensor(new, dtype=torch.long)
    timings["forward_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t0

    linear_compute = args.dtype
    if method == "awq" and compute_dtype == torch.float32:
        # AwqTorchLinear.forward casts non-half inputs to float16, multiplies, and casts back.
        linear_compute = "float16 inside AwqTorchLinear (input cast to fp16 and back); rest of the model float32"
    metadata = {
        "method": method,
        "backend": backend.value,
        "kernels": json.dumps(sorted(kernels)),
        "dequantize_functions": json.dumps(sorted(dequant_functions)),
        "load_dtype": str(load_dtype).removeprefix("torch."),
        "compute_dtype": args.dtype,
        "linear_compute": linear_compute,
        "restored_from_checkpoint": str(restored),
        "prompts": json.dumps(prompts),
        "greedy_tokens": str(GREEDY_TOKENS),
        "quantization_config": json.dumps(qconfig, sort_keys=True),
        "versions": json.dumps(_versions()),
        "timings": json.dumps(timings),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(args.out), metadata=metadata)
    summary = {
        "out": str(args.out),
        "modules": sum(1 for k in out if k.endswith(".weight")),
        "kernels": sorted(kernels),
        "load_dtype": metadata["load_dtype"],
        "linear_compute": linear_compute,
        "greedy": {k: out[k].tolist() for k in out if k.startswith("greedy.")},
        "timings": timings,
    }
    _log(f"wrote {args.out} in {timings['total_s']:.1f}s")
    print(json.dumps(summary))
    return summary


# ------------------------------------------------------------------------------------------------- main


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("produce", help="quantize a plain checkpoint with GPTQModel")
    p.add_argument("--plain", required=True, help="unquantized HF checkpoint directory")
    p.add_argument("--out", required=True, help="output directory (replaced)")
    p.add_argument("--method", choices=["gptq", "awq"], required=True)
    p.add_argument("--bits", type=int, choices=[2, 3, 4, 8], default=4)
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--sym", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--desc-act", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--true-sequential", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--act-group-aware",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="GPTQ: GPTQModel's group-aware reordering (default: GPTQModel's, i.e. on, but off with --desc-act or "
        "--group-size -1, which it refuses)",
    )
    p.add_argument("--lm-head", action=argparse.BooleanOptionalAction, default=False, help="quantize lm_head too")
    p.add_argument(
        "--dtype",
        choices=["float16", "bfloat16", "float32"],
        default="float16",
        help="dtype GPTQModel loads the plain model in; the unquantized tensors are saved in it (default float16, "
        "as in most published GPTQ/AWQ checkpoints; GPTQModel's own default on CPU is bfloat16)",
    )
    p.set_defaults(func=produce)

    r = sub.add_parser("reference", help="load a GPTQ/AWQ checkpoint with GPTQModel and dump what it computes")
    r.add_argument("--model", required=True)
    r.add_argument("--out", required=True, help="output .safetensors file")
    r.add_argument("--prompts-ids", help="JSON file: list of lists of token ids")
    r.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default="float32",
        help="activation dtype of the reference forward (default float32)",
    )
    r.set_defaults(func=reference)

    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
