"""Calls into worker processes that can be killed, for work no thread can stop and an input can make unbounded:
rendering a client's Jinja template, compiling a regex into a token automaton (outlines-core, whose compile
time grows exponentially with some short patterns).

A call runs ``module.function(*args)`` in an idle worker (``python -m fw.sdk.workers``, started when none is idle)
under a time limit. A worker that outlives it, or whose call is cancelled, is killed, so the CPU and memory it
held come back at once; the call fails with TimeoutError or CancelledError. Workers run under an
address-space limit, so a call that would exhaust memory fails with MemoryError (or its worker dies, a
WorkerError) instead of hurting the server.
"""

from __future__ import annotations

import importlib
import pickle
import resource
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any

POLL_S = 0.05  # how often a waiting call looks at its cancellation


class WorkerError(RuntimeError):
    """A worker died (killed by the kernel, say) before it answered."""


class WorkerPool:
    """At most ``size`` worker processes, each running one call at a time; further calls wait for one."""

    def __init__(self, size: int, memory_limit: int | None = None, name: str = "fw-worker") -> None:
        self.memory_limit = memory_limit
        self._slots = threading.BoundedSemaphore(size)
        self._threads = ThreadPoolExecutor(size, thread_name_prefix=name)
        self._idle: list[subprocess.Popen] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any, timeout: float) -> Future:
        """``call`` on one of the pool's own threads."""
        return self._threads.submit(self.call, fn, *args, timeout=timeout)

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float, cancel: threading.Event | None = None) -> Any:
        """Run ``fn(*args)`` in a worker and return its result; ``fn`` is a module-level function, its arguments and
        result are pickled. ``timeout`` counts from the call's start in its worker; setting ``cancel`` kills it."""
        with self._slots:
            return self._call(fn, args, timeout, cancel or threading.Event())

    def _call(self, fn: Callable[..., Any], args: tuple, timeout: float, cancel: threading.Event) -> Any:
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        worker = worker or self._spawn()
        try:
            pickle.dump((fn.__module__, fn.__qualname__, args), worker.stdin)
            worker.stdin.flush()
            deadline = time.monotonic() + timeout
            while not select.select([worker.stdout], [], [], POLL_S)[0]:
                if cancel.is_set():
                    raise CancelledError()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"took longer than {timeout:g} s")
            ok, value = pickle.load(worker.stdout)
        except BaseException as exc:  # timed out, cancelled, interrupted or dead: the worker goes
            worker.kill()
            status = worker.wait()
            if isinstance(exc, (BrokenPipeError, EOFError, pickle.UnpicklingError)):
                raise WorkerError(f"the worker process died (exit status {status})") from None
            raise
        with self._lock:
            self._idle.append(worker)
        if ok:
            return value
        raise value

    def _spawn(self) -> subprocess.Popen:
        limit = [str(self.memory_limit)] if self.memory_limit else []
        return subprocess.Popen([sys.executable, "-m", "fw.sdk.workers", *limit], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE)


def _serve(memory_limit: int | None) -> None:
    """A worker: answer pickled calls on stdin with pickled (ok, result or exception) on stdout until EOF."""
    if memory_limit:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    calls, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must not corrupt the replies
    while True:
        try:
            module, name, args = pickle.load(calls)
        except EOFError:
            return  # the parent has gone
        try:
            reply = (True, getattr(importlib.import_module(module), name)(*args))
        except Exception as exc:  # noqa: BLE001 - the caller's to handle
            reply = (False, exc)
        try:
            data = pickle.dumps(reply)
        except Exception as exc:  # noqa: BLE001 - an unpicklable result or exception, or no memory for it
            data = pickle.dumps((False, WorkerError(f"the reply could not be sent: {type(exc).__name__}: {exc}")))
        replies.write(data)
        replies.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]) if len(sys.argv) > 1 else None)
