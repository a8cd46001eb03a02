"""Where an engine step's time goes, by timers at the plugin boundaries (``fw bench latency --profile``).

While a ``StepProfile`` is entered, each call into these parts of an in-process engine is timed:
- each linear layer, by its quant method and the kernel it chose for one row (``fw.sdk.kernels``);
- the attention backend, the embedding, the LM head, and each other leaf layer of the model by its class (norms,
  rotary, activation);
- sampling, and the engine's own work around the forward pass (scheduling, outputs).
What remains of the forward pass is ``Python and small ops``: the code that glues the layers together and the tensor
ops between them. Times are exclusive (a layer timed inside another counts once, in the inner one), so the parts add
up to the steps' wall time. A timer costs about a microsecond a call.

A captured decode step (``fw.decode_graph``) runs no Python to split: while profiling, steps run eagerly.
Only the rank-0 runner of this process is timed.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from torch import nn

from fw.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from fw.layers.linear import LinearBase
from fw.sdk.kernels import Selection

PYTHON = "Python and small ops (forward)"
ENGINE = "engine: scheduling, outputs"


def _linear_part(layer: LinearBase) -> str:
    """``linear <op>/<kernel>``: the kernel-choice operation and the candidate chosen for one row, where the layer's
    method made one, else the method's class."""
    method = layer.linear_method
    for owner in (method, getattr(layer, "weight", None)):
        kernel = getattr(owner, "kernel", None)
        if isinstance(kernel, Selection):
            return f"linear {kernel.op}/{kernel.names[0]}"
    return f"linear {type(method).__name__}"


def _module_part(module: nn.Module) -> str | None:
    """The part a model module's time goes to; None for modules made of others (their glue is Python)."""
    if isinstance(module, LinearBase):
        return _linear_part(module)
    if isinstance(module, ParallelLMHead):
        return "LM head"
    if isinstance(module, VocabParallelEmbedding):
        return "embedding"
    if next(module.children(), None) is None:
        return type(module).__name__
    return None


class StepProfile:
    """Per part, the seconds spent in the engine's steps while entered (``parts``), and the steps counted."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.runner = engine.executor.runner
        self.parts: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._inner: list[float] = []  # per open timer: the time of the timers opened inside it
        self._patched: list[tuple[object, str, Any]] = []  # (object, attribute, its own value before, or None)
        self.captured = self.runner.graphs is not None  # whether the engine replays captured decode steps
        self._graphs = None

    def _timer(self, part: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._inner.append(0.0)
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.parts[part] += elapsed - self._inner.pop()
                if self._inner:
                    self._inner[-1] += elapsed
        return timed

    def _wrap(self, owner: object, attribute: str, part: str) -> None:
        # An attribute of the instance shadows its class's method; on exit the instance's own value comes back.
        self._patched.append((owner, attribute, vars(owner).get(attribute)))
        setattr(owner, attribute, self._timer(part, getattr(owner, attribute)))

    def __enter__(self) -> StepProfile:
        engine, runner = self.engine, self.runner
        self._wrap(engine, "_step", ENGINE)
        self._wrap(engine, "_sample", "sampling")
        self._wrap(runner, "execute", PYTHON)
        self._wrap(runner.attention, "forward", f"attention {type(runner.attention).__name__}")
        for module in runner.model.modules():
            part = _module_part(module)
            if part is not None:
                self._wrap(module, "forward", part)
            if isinstance(module, ParallelLMHead):  # greedy steps' argmax of the logits (StepInputs.argmax_only)
                self._wrap(module, "greedy", part)
        self._graphs, runner.graphs = runner.graphs, None
        step = engine.step

        def counted() -> Any:
            self.steps += 1
            return step()

        self._patched.append((engine, "step", vars(engine).get("step")))
        engine.step = counted
        return self

    def __exit__(self, *exc: object) -> None:
        self.runner.graphs = self._graphs
        for owner, attribute, own in reversed(self._patched):
            if own is None:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, own)
        self._patched.clear()

    def table(self) -> list[tuple[str, float, float]]:
        """(part, ms a step, share of the steps' time), largest first; the shares add up to 1."""
        total = sum(self.parts.values())
        rows = sorted(self.parts.items(), key=lambda item: -item[1])
        return [(part, 1000 * seconds / max(self.steps, 1), seconds / total if total else 0.0) for part, seconds in rows]
