"""An asyncio front for the engine: the engine steps in its own thread, callers await their outputs.

All engine calls happen on the engine thread (the engine is not thread-safe);
the event loop only enqueues commands and receives outputs, so HTTP handling
and engine steps overlap. A caller that stops iterating (client disconnect,
cancellation) has its request aborted and its KV blocks freed at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from fw.engine import LLMEngine
from fw.outputs import RequestOutput
from fw.sampling_params import SamplingParams

log = logging.getLogger("fw")


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
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
        loop, q = target
        loop.call_soon_threadsafe(q.put_nowait, output)
        if output.finished:
            self._streams.pop(output.request_id, None)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every step it takes part in, the last one finished."""
        request_id = request_id or f"req-{next(self._ids)}"
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        try:
            await asyncio.wrap_future(self._call(lambda: self.engine.add_request(prompt, params, request_id)))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finished = False
        try:
            while not finished:
                output = await q.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self._streams.pop(request_id, None)
                self._call(lambda: self.engine.abort_request(request_id))

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
