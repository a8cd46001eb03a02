"""An asyncio front for the engine (an ``EngineClient``): the engine steps in its own thread, callers await their
outputs.

All engine calls happen on the engine thread (the engine is not thread-safe);
the event loop only enqueues commands and receives outputs, so HTTP handling
and engine steps overlap. A caller that stops iterating (client disconnect,
cancellation) has its requests aborted and their KV blocks freed at once.

One request cannot end another's: a step that fails is pinned on the requests
that caused it where the engine can tell (``RequestError``), or else on the
step's newest admissions; those fail with the error and the step runs again
without them. Only a failure that recurs without them aborts everything.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any

from fw.engine.client import EngineError, EngineStats, Submission
from fw.engine.core import LLMEngine
from fw.interfaces.hooks import EngineView
from fw.interfaces.sampler import RequestError
from fw.outputs import RequestOutput

log = logging.getLogger("fw")


class Outbox:
    """A caller's unread outputs, on its event loop: only the newest per request, since an output holds all so
    far (a slow reader holds one output per request, not one per step). An error is never replaced."""

    def __init__(self) -> None:
        self.unread: dict[int, RequestOutput | Exception] = {}
        self.ready = asyncio.Event()

    def put(self, index: int, item: RequestOutput | Exception) -> None:
        if not isinstance(self.unread.get(index), Exception):
            self.unread.pop(index, None)  # re-inserted: the caller reads news in the order they came
            self.unread[index] = item
            self.ready.set()

    async def take(self) -> list[tuple[int, RequestOutput | Exception]]:
        await self.ready.wait()
        self.ready.clear()
        items, self.unread = list(self.unread.items()), {}
        return items


def _put_all(items: list[tuple[Outbox, int, RequestOutput | Exception]]) -> None:
    for outbox, index, output in items:
        outbox.put(index, output)


class AsyncEngine:
    """``engine``: an engine, or a function that builds one, which is then built on the engine thread (and what it
    raises is raised here). Prefer the function on a CPU: OpenMP (libgomp) stops spinning between parallel regions
    once more threads than CPUs have run them, and a model loaded on the caller's thread leaves that thread's
    OpenMP team behind; the engine's own team then sleeps and wakes around every op. With Qwen2-0.5B on two
    cores, `fw serve`'s two compute threads made ~10,000 and ~17,000 voluntary context switches in a 32-request
    run against ~100 and ~20 once the engine thread built the engine, as offline."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine]) -> None:
        self._commands: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        # Request id -> where its outputs go: the caller's loop, its outbox, the request's index in its batch.
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, Outbox, int]] = {}
        self._running = True
        built: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(engine, built), name="fw-engine", daemon=True)
        self._thread.start()
        built.result()  # waits for the engine; raises what building it raised

    def _run(self, engine: LLMEngine | Callable[[], LLMEngine], built: Future) -> None:
        try:
            self.engine: LLMEngine = engine if isinstance(engine, LLMEngine) else engine()
        except BaseException as exc:  # noqa: BLE001 - raised by the constructor, on the caller's thread
            built.set_exception(exc)
            return
        self.view: EngineView = self.engine.view
        built.set_result(None)
        self._loop()

    def _call(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._commands.put((fn, future))
        return future

    def _loop(self) -> None:
        while self._running:
            # Block for work only when the engine is idle; otherwise take what is queued and step.
            block = not self._busy()
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
            self._deliver_all(self._step())

    def _busy(self) -> bool:
        """Whether the engine thread steps rather than waits for a command."""
        return self.engine.has_unfinished_requests()

    def _step(self) -> list[RequestOutput]:
        """An engine step; when it fails, the requests it is pinned on fail and it runs again (module doc)."""
        blamed_newest = False
        # With no requests left, a step still completes the KV connector's transfers (held blocks, aborted loads).
        while self.engine.has_live_work():
            try:
                return self.engine.step()
            except Exception as exc:
                if not self.engine.groups:
                    log.exception("engine step failed while completing KV transfers")
                    return []
                named = exc.errors if isinstance(exc, RequestError) else {}
                culprits = {request_id: e for request_id, e in named.items() if request_id in self.engine.groups}
                if culprits:
                    log.warning("engine step failed; failing the requests that caused it: %s", exc)
                else:
                    log.exception("engine step failed")
                    # Requests that finished in a step that failed late would otherwise never be delivered.
                    for request_id, sequences in list(self.engine.groups.items()):
                        if all(seq.finished for seq in sequences):
                            self._deliver(self.engine.abort_request(request_id))
                    newest = self.engine.last_admitted()
                    # Once it failed without the newest admissions too, nothing is left to blame but everything.
                    culprits = dict.fromkeys(list(self.engine.groups) if blamed_newest else newest, exc)
                    blamed_newest = True
            for request_id, error in culprits.items():
                self._fail(request_id, error)
        return []

    def _fail(self, request_id: str, error: Exception) -> None:
        """Abort a request and hand its caller ``error``; a ValueError is the request's fault (an EngineError)."""
        output = self.engine.abort_request(request_id)
        if output is not None:
            is_request_fault = isinstance(error, ValueError) and not isinstance(error, EngineError)
            self._deliver(output, EngineError(str(error)) if is_request_fault else error)

    def _deliver_all(self, outputs: list[RequestOutput], error: Exception | None = None) -> None:
        """Outputs (or ``error`` in their place) to their callers: one wake-up per caller's event loop, not one per
        request (a step of 32 streams would wake the server's loop 32 times)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Outbox, int, RequestOutput | Exception]]] = {}
        for output in outputs:
            target = self._streams.get(output.request_id)
            if target is None:
                continue
            loop, outbox, index = target
            by_loop.setdefault(loop, []).append((outbox, index, error or output))
            if output.finished:
                self._streams.pop(output.request_id, None)
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver(self, output: RequestOutput, error: Exception | None = None) -> None:
        self._deliver_all([output], error)

    async def generate_many(self, requests: Sequence[Submission]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run (prompt, params, request id, priority) requests together: yield (index, output) as they step (an
        output a slow caller has not read yet is replaced by the next), each request's last output finished.

        All are admitted by one engine-thread command, so the scheduler batches them from the first step,
        and a request the engine refuses fails them all before any output; so does one the engine fails later
        (raising its error: an EngineError when the request's input is to blame).
        """
        loop, outbox = asyncio.get_running_loop(), Outbox()
        ids = [request_id for _prompt, _params, request_id, _priority in requests]

        def admit() -> None:
            added = []
            try:
                for index, (prompt, params, request_id, priority) in enumerate(requests):
                    self.engine.add_request(prompt, params, request_id, priority)
                    added.append(request_id)
                    self._streams[request_id] = (loop, outbox, index)
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
                for index, item in await outbox.take():
                    if isinstance(item, Exception):
                        raise item
                    if item.finished:
                        pending.discard(ids[index])
                    yield index, item
        finally:
            if pending:
                self._call(lambda: self._abort_now(pending))

    def _abort_now(self, request_ids) -> None:
        """On the engine thread: stop delivering to and abort these requests."""
        for request_id in request_ids:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

    def _abort_all(self) -> None:
        for request_id in list(self.engine.groups):
            self.engine.abort_request(request_id)

    def stats(self) -> EngineStats:
        """The engine's latest published snapshot (any thread may read it)."""
        return self.engine.stats()

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def shutdown(self) -> None:
        """Abort whatever still runs, stop the thread, release the engine."""
        self._call(self._abort_all).result(timeout=30)
        self._running = False
        self._thread.join(timeout=30)
        self.engine.shutdown()
