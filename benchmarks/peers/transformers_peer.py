"""Hugging Face transformers `generate` (bf16, eager PyTorch) on fw bench's workload; prints one JSON line.

python benchmarks/peers/transformers_peer.py --model DIR
"""

from __future__ import annotations

import time

import common


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    common.enter_venv("transformers")
    import torch
    import transformers
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(common.THREADS)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()

    class Clock(BaseStreamer):
        """generate() puts the prompt first, then every new token: the second put is the first token."""

        def __init__(self):
            self.puts = []

        def put(self, value):
            self.puts.append(time.perf_counter())

        def end(self):
            pass

    def generate(prompts: list[list[int]], output_len: int, streamer=None) -> torch.Tensor:
        ids = torch.tensor(prompts)  # equal lengths: no padding
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=0,
            streamer=streamer,
        )
        assert out.shape[1] == ids.shape[1] + output_len
        return out

    def single(prompt: list[int], output_len: int) -> tuple[float, float]:
        clock = Clock()
        with torch.inference_mode():
            generate([prompt], output_len, clock)
        return clock.puts[1], time.perf_counter()

    def batch(prompts: list[list[int]], output_len: int) -> None:
        with torch.inference_mode():
            generate(prompts, output_len)

    result = common.run_workload(args, model.config.vocab_size, single, batch)
    common.emit("transformers", args, {"transformers": transformers.__version__, "torch": torch.__version__}, result)


if __name__ == "__main__":
    main()
