"""A data-parallel replica whose forward passes need every replica (expert parallelism; fw.data_parallel's doc).

It steps in lockstep rounds with the others: each of its own forward passes opens one (through the engine's
``before_forward`` seam), and when its engine thread steps without one it opens one all the same, joining another
replica's forward pass with a dummy step if there is one.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from fw import distributed
from fw.engine.async_engine import AsyncEngine
from fw.engine.core import LLMEngine
from fw.layers.moe import FusedMoE
from fw.outputs import RequestOutput

log = logging.getLogger("fw")

IDLE, WORK, FORWARD = 0, 1, 2  # a replica in a round: no requests; requests, but no batch now; a forward pass now


class LockstepEngine(AsyncEngine):
    """A round opens with an all-reduce of each replica's state, the newest request it has heard of and whether it
    stays. Every forward pass of its own opens one (FORWARD); when the engine thread steps without one (no requests,
    or none it can schedule now) it opens one all the same, and if another replica runs a forward pass in it, this
    one runs the MoE layers' collectives with no tokens (a dummy step).
    """

    def __init__(self, engine: LLMEngine, calls: dict) -> None:
        self.calls = calls  # the front's calls this replica runs: work before their requests reach the engine
        self.heard = self.agreed = 0  # the newest request heard of; the newest all had heard of when all were idle
        self.wave = self.leaving = False  # the last round said to go on; this replica is shutting down
        self.left = threading.Event()  # every replica is shutting down: no more rounds
        self.rounds = self.dummy_steps = 0
        runner = engine.executor.runner
        self._moe = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]  # in the order a forward runs them
        self._dtype, self._device = runner.dtype, runner.device
        self._timeout = engine.config.parallel.distributed_timeout
        engine.before_forward = lambda: self._round(forward=True)  # each forward pass of this replica's opens a round
        super().__init__(engine)

    def hear(self, number: int) -> None:
        """The front sent the request ``number`` to some replica (to this one before telling it)."""
        self.heard = number
        self._call(lambda: None)  # wakes the engine thread if it waits for a command

    def _has_work(self) -> bool:
        return bool(self.calls) or super()._busy()

    def _busy(self) -> bool:
        return not self.left.is_set() and (self.wave or self.leaving or self.heard > self.agreed or self._has_work())

    def _step(self) -> list[RequestOutput]:
        if not self._busy():  # the wait for a command timed out
            return []
        rounds = self.rounds
        outputs = super()._step()
        if self.rounds == rounds:  # no forward pass of its own: a round all the same
            self._round(forward=False)
        return outputs

    def _round(self, forward: bool) -> None:
        # Read before the work it covers: the front's call to this replica is in ``calls`` before it is heard of.
        heard = self.heard
        state = FORWARD if forward else WORK if self._has_work() else IDLE
        try:
            top, newest, oldest, staying = distributed.get_control_plane().max(
                [state, heard, -heard, int(not self.leaving)]
            )
            if top == FORWARD and not forward:
                self._dummy_step()
        except RuntimeError:  # a replica is gone or failed mid-step: the others cannot step without it
            log.exception("data-parallel replica: a lockstep round failed; exiting")
            os._exit(1)
        self.rounds += 1
        # Rounds stop once no replica has work and all have heard of the same requests: any later request is then
        # news to every replica, so each opens the next round.
        self.wave = top != IDLE or newest != -oldest
        if not self.wave:
            self.agreed = newest
        if not staying:
            self.left.set()

    @torch.inference_mode()
    def _dummy_step(self) -> None:
        """Another replica's forward pass, joined without tokens: each MoE layer's dispatch and combine, in the
        forward pass's order, this replica's experts computing the tokens sent to them."""
        self.dummy_steps += 1
        for layer in self._moe:
            hidden = torch.empty(0, layer.spec.hidden_size, dtype=self._dtype, device=self._device)
            weights = torch.empty(0, layer.top_k, device=self._device)
            layer.run(hidden, weights, weights.long())

    def shutdown(self) -> None:
        def leave() -> None:
            self._abort_all()
            self.leaving = True

        self._call(leave)
        # The replicas leave in one round: one that stopped stepping would hold the others' next round forever.
        self.left.wait(self._timeout)
        super().shutdown()
