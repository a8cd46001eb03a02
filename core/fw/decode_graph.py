"""Captured decode steps: a small decode step's forward pass, replayed without Python.

At a few requests a CPU decode step spends as long in Python (module calls, plugin glue, op dispatch) as in its
kernels: half of SmolLM2-135M Q4_1's 30 ms a token on two Zen 3 cores. So the runner records such a step once per
batch size with ``torch.jit.trace`` (the ops, with weights and KV caches as constants and the step's tensors as
inputs) and replays that graph in torch's C++ interpreter from then on. A decode step whose requests also verify
speculative drafts (a few new tokens each, every one sampled) is captured the same way, per count of requests and
of tokens.

A graph is right only if the step's ops depend on nothing but those inputs. Three guards:
- The model class (``decode_graphs = True``) and the attention backend (``supports_decode_graphs()``) say so:
  their decode path reads no host-side value that changes from step to step.
- A tensor's values read into Python while tracing (``.item()``, ``.tolist()``) abandon the capture, as does an op
  the tracer cannot record.
- A new graph's first replay runs beside the eager step, and the two must give the same hidden states, bit for bit.
After a failure every decode step runs eagerly, with one warning (the next size would fail alike), except when the
tracer cannot record an op: only that shape stays eager, and the others still replay. Kernel choice picks kernels per
row count, and a candidate a trace cannot hold (oneDNN's prepacked weights) is chosen at the captured sizes only
where it times far faster (``fw.sdk.kernels.CAPTURED_ROWS``): the sizes it runs are not traced at all, and say so
at INFO (``fw.sdk.kernels.untraceable``), since they run eagerly by that choice.
``--enforce-eager`` turns capturing off.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from fw.forward_context import set_forward_context
from fw.interfaces.attention import GRAPH_MAX_QUERY_LEN, AttentionBatch
from fw.sdk import kernels

if TYPE_CHECKING:
    from fw.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Steps of up to this many requests are captured. A capture costs a trace and a step run twice (0.27 s for
# Qwen2-0.5B's 24 layers at 1-32 requests on two Zen 5 cores), and a replay saves the step's Python: SmolLM2-135M
# Q4_1 on two Zen 3 cores, ms a step eager -> replayed: 1 request 28.1 -> 17.4, 8: 66.2 -> 50.9; bf16 Qwen2-0.5B
# on Zen 5, eager and replayed steps in turns: 16 requests 70.7 -> 64.2, 32: 64.1 -> 56.9 and 57.8 -> 52.4.
MAX_BATCH = kernels.CAPTURED_ROWS
# Sizes up to SMALL_BATCH are captured when they first recur: their capture pays off within ~30 replays. Larger ones
# need ~45 at 6 ms a replay, while a burst's shrinking batch passes through sizes it runs only a few steps each: they
# are captured once they have run LARGE_RECURRENCE steps (a server's steady load, a batch job's many same steps).
SMALL_BATCH = 8
LARGE_RECURRENCE = 32
# Graphs kept at most: with speculative decoding a batch's token count varies with its drafts (one graph each).
MAX_GRAPHS = 32

# TracerWarnings that mean a tensor's values were read into Python, so the trace would replay one step's values
# forever. Booleans and integers are left out: the tracer reports sizes that way too, and a graph is per size.
_DATA_DEPENDENT = r"Converting a tensor to a Python (number|float|list)"

_CHECK, _READY, _EAGER = "check", "ready", "eager"


Shape = tuple[int, int]  # (requests, tokens) of a step


class DecodeGraphs:
    """Per shape (requests, tokens): steps run eagerly until the shape recurs (the first makes the kernel choices),
    the next is traced, the one after checked against eager; later ones replay."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._seen: dict[Shape, int] = {}  # eager steps per shape not captured yet
        self._state: dict[Shape, str] = {}
        self._graphs: dict[Shape, Callable[..., torch.Tensor]] = {}
        self.replayed: dict[Shape, int] = {}  # steps replayed, per shape
        self.off: str | None = None  # why every step runs eagerly
        self.untraced: dict[Shape, str] = {}  # shapes whose steps the tracer could not record, and why

    def reset(self) -> None:
        """Forgets every graph, and why capturing stopped: the kernels changed (``fw.sdk.kernels.refresh``)."""
        self._seen.clear()
        self._state.clear()
        self._graphs.clear()
        self.untraced.clear()
        self.off = None

    def hidden(self, batch: AttentionBatch, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The final hidden states of a step whose every token is sampled, one row per token; None when the step
        should run eagerly. The LM head runs after, eagerly: greedy steps need only its argmax (``argmax_only``)."""
        size = (batch.num_reqs, len(input_ids))
        if self.off or batch.max_query_len > GRAPH_MAX_QUERY_LEN or batch.num_reqs > MAX_BATCH:
            return None
        inputs = (input_ids, positions, batch.query_start_loc, batch.seq_lens, batch.block_tables, batch.slot_mapping)
        state = self._state.get(size)
        if state == _READY:
            self.replayed[size] = self.replayed.get(size, 0) + 1
            return self._replay(size, inputs)
        if state == _EAGER:
            return None
        if state is None:
            seen = self._seen.get(size, 0)
            if seen < (1 if size[0] <= SMALL_BATCH else LARGE_RECURRENCE) or len(self._graphs) >= MAX_GRAPHS:
                self._seen[size] = seen + 1
                return None
            del self._seen[size]
            if not self.runner.attention.supports_decode_graphs():
                self._stop(f"the attention backend {type(self.runner.attention).__name__} does not support them",
                           logging.INFO)
                return None
            if held := kernels.untraceable(self.runner.model, size[1]):  # chosen, for their speed, knowing this
                self._state[size] = _EAGER
                self.untraced[size] = why = f"the kernels chosen for {size[1]} rows ({', '.join(held)}) are not traceable"
                logger.info("decode steps of %d requests and %d tokens run eagerly: %s", *size, why)
                return None
            return self._capture(batch, inputs)
        return self._check(batch, inputs)

    def _replay(self, size: Shape, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        with torch.jit.optimized_execution(False):  # the graph as recorded: no fusion to change the numbers
            return self._graphs[size](*inputs)

    def _run(self, batch: AttentionBatch, *inputs: torch.Tensor) -> torch.Tensor:
        """The eager step on ``inputs``, as a function of them alone: ``batch`` gives only what the trace keeps."""
        input_ids, positions, query_start_loc, seq_lens, block_tables, slot_mapping = inputs
        step = AttentionBatch(
            query_start_loc, seq_lens, block_tables, slot_mapping, batch.block_size, batch.max_query_len,
            batch.max_seq_len, batch.query_start_loc_cpu, batch.seq_lens_cpu,
        )
        runner = self.runner
        with set_forward_context(runner.attention.prepare(step), runner.layer_caches):
            return runner.model(input_ids, positions)

    def _capture(self, batch: AttentionBatch, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        size = (batch.num_reqs, len(inputs[0]))
        result: list[torch.Tensor] = []

        def step(*args: torch.Tensor) -> torch.Tensor:
            result.append(self._run(batch, *args))
            return result[-1]

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                graph = torch.jit.trace(step, inputs, check_trace=False)
            except Exception as e:  # the tracer does not know every op (float8 dtype views); the eager step redoes it
                self._state[size] = _EAGER
                self.untraced[size] = why = f"tracing the step failed ({type(e).__name__}: {str(e).splitlines()[0]})"
                level = logging.INFO if len(self.untraced) > 1 else logging.WARNING  # one warning
                logger.log(level, "decode steps of %d requests and %d tokens run eagerly: %s", *size, why)
                return None
        for warning in caught:
            if warning.category is torch.jit.TracerWarning and re.match(_DATA_DEPENDENT, str(warning.message)):
                self._stop(f"the step reads a tensor into Python ({warning.filename}:{warning.lineno})")
                return result[0]  # right for this step, which ran as it was traced
        self._graphs[size], self._state[size] = graph, _CHECK
        return result[0]

    def _check(self, batch: AttentionBatch, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        size = (batch.num_reqs, len(inputs[0]))
        replayed = self._replay(size, inputs)
        eager = self._run(batch, *inputs)  # writes the same KV the replay did
        if torch.equal(replayed, eager):
            self._state[size] = _READY
        else:
            diff = (replayed - eager).abs().max()
            self._stop(f"the replay of a step of {size[0]} requests and {size[1]} tokens differs from the eager step by "
                       f"up to {diff:.3g}")
        return eager

    def _stop(self, why: str, level: int = logging.WARNING) -> None:
        self.off = why
        self._graphs.clear()
        logger.log(level, "decode steps run eagerly: %s", why)
