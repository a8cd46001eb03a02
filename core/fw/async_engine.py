"""An asyncio front for the engine: the engine steps in its own thread, callers await their outputs.

All engine calls happen on the engine thread (the engine is not thread-safe);
the event loop only enqueues commands and receives outputs, so HTTP handling
and engine steps overlap. A caller that stops iterating (client disconnect,
cancellation) has its requests aborted and their KV blocks freed at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any

from fw.engine import LLMEngine
from fw.inputs import PromptType
from fw.outputs import RequestOutput
from fw.sampling_params import SamplingParams

log = logging.getLogger("fw")


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        # Request id -> where its outputs go: the caller's loop, its queue, the request's index in its batch.
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, int]] = {}
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="fw-engine", daemon=True)
        self._thread.start()

    def _call(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._commands.put((fn, future))
        return future

    def _loop(self) -> None:
        while self._running:
            # Block for work only when the engine is idle; otherwise take what is queued and step.
            block = not self.engine.has_unfinished_requests()
            try:
                fn, future = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                fn = None
            if fn is not None:
                if not future.set_running_or_notify_cancel():  # its caller has gone: don't run it
                    continue
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
                    future.set_exception(exc)
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # a broken step must not hang every client: abort what runs, keep serving
                log.exception("engine step failed; aborting the running requests")
                outputs = [o for rid in list(self.engine.groups) if (o := self.engine.abort_request(rid))]
            for output in outputs:
                self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        target = self._streams.get(output.request_id)
        if target is None:
            return
        loop, q, index = target
        loop.call_soon_threadsafe(q.put_nowait, (index, output))
        if output.finished:
            self._streams.pop(output.request_id, None)

    async def generate_many(
        self, requests: Sequence[tuple[PromptType, SamplingParams, str, int]]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run (prompt, params, request id, priority) requests together: yield (index, output) after every step
        a request takes part in, its last output finished.

        All are admitted by one engine-thread command, so the scheduler batches them from the first step,
        and a request the engine refuses fails them all before any output.
        """
        loop, q = asyncio.get_running_loop(), asyncio.Queue()
        ids = [request_id for _prompt, _params, request_id, _priority in requests]

        def admit() -> None:
            added = []
            try:
                for index, (prompt, params, request_id, priority) in enumerate(requests):
                    self.engine.add_request(prompt, params, request_id, priority)
                    added.append(request_id)
                    self._streams[request_id] = (loop, q, index)
            except BaseException:
                self._abort_now(added)
                raise

        admitted = self._call(admit)
        try:
            await asyncio.wrap_future(admitted)
        except asyncio.CancelledError:
            # Admission may be under way on the engine thread: abort what it adds.
            admitted.add_done_callback(lambda f: f.cancelled() or f.exception() or self._call(lambda: self._abort_now(ids)))
            raise
        pending = set(ids)
        try:
            while pending:
                index, output = await q.get()
                if output.finished:
                    pending.discard(ids[index])
                yield index, output
        finally:
            if pending:
                self._call(lambda: self._abort_now(pending))

    def _abort_now(self, request_ids) -> None:
        """On the engine thread: stop delivering to and abort these requests."""
        for request_id in request_ids:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

    async def run(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread (for reading stats consistently)."""
        return await asyncio.wrap_future(self._call(lambda: fn(self.engine)))

    def shutdown(self) -> None:
        """Abort whatever still runs, stop the thread, release the engine."""

        def abort_all() -> None:
            for request_id in list(self.engine.groups):
                self.engine.abort_request(request_id)

        self._call(abort_all).result(timeout=30)
        self._running = False
        self._thread.join(timeout=30)
        self.engine.shutdown()
