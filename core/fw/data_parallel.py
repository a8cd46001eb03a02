"""Data parallelism behind one server: ``fw serve -dp N`` runs N engine replicas, each in its own process with
its own scheduler and KV cache, and routes every request to one of them.

The server talks to a ``DataParallelEngine`` as it talks to one ``AsyncEngine``: both are ``EngineClient``s
(fw.engine.client). Each replica process runs an ``AsyncEngine`` over its own ``LLMEngine`` (on a GPU machine, device
``cuda:<replica>``), so a request that fails a step fails there exactly as with one engine; the front forwards
requests, outputs and aborts over a pipe per replica.

Routing: the replica that holds the longest cached prefix of the prompt, as far as the front remembers the prompts
it sent there (their block hashes, chained as the prefix cache chains them), unless it carries more than
``BALANCE`` requests above the least loaded replica; otherwise, and for a prompt no replica has seen, the least
loaded. Each replica reports its queues, KV-cache use and prefix-cache counts every ``STATS_INTERVAL_S``; /metrics
shows them per replica (label ``engine``, as vLLM does), with the requests routed to each.

With ``--enable-expert-parallel`` the replicas are one torch.distributed world whose expert-parallel group spans
them all, as vLLM's does: each holds its share of every MoE layer's experts, and each forward pass's dispatch and
combine are collectives over every replica. So the replicas step in lockstep (fw.engine.lockstep): in rounds, each
opened by a small all-reduce on the control plane that says whether anyone runs a forward pass now; a replica
without one then runs a dummy step: each MoE layer's dispatch and combine with no tokens of its own, its experts
computing the tokens the others send them (no attention, no KV-cache writes, no output). When no replica has work
the rounds stop, and the server waits without stepping. A request
wakes them: the front tells every replica of it (a number, after the request itself to its replica), and the
rounds only stop once every replica has heard of every request and none has work, so a replica never starts a
round the others will not join. Shutdown is a round too: the replicas leave together.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import torch

from fw import distributed, plugins
from fw.config import FwConfig, config_class, picklable
from fw.engine.async_engine import AsyncEngine, Outbox
from fw.engine.client import EngineError, EngineStats, ReplicaStats, Submission
from fw.engine.core import LLMEngine
from fw.engine.lockstep import LockstepEngine
from fw.inputs import PromptType
from fw.interfaces.hooks import EngineView
from fw.outputs import RequestOutput
from fw.platform import detect
from fw.sdk.block_hash import block_hash_chain

log = logging.getLogger("fw")

BALANCE = 4  # requests in flight a cache-warm replica may carry above the least loaded one and still be chosen
REMEMBERED_BLOCKS = 1 << 16  # per replica: block hashes of the prompts routed there, least recent forgotten
STATS_INTERVAL_S = 0.5
START_TIMEOUT_S = 600.0


# --- the replica process ----------------------------------------------------------------------------------------


def _join_replicas(config: FwConfig, rank: int, init_method: str) -> type:
    """Join the replicas' world (expert parallelism): its data- and expert-parallel groups span every replica."""
    comm_cls, options = plugins.load_driver("comm", config.comm.name, config.comm.options)
    layout = distributed.ParallelLayout(data_parallel_size=config.parallel.data_parallel_size, expert_parallel=True)
    device = detect(config.model.device).device
    distributed.init_parallel(comm_cls, rank, layout, init_method, device, options, config.parallel.distributed_timeout)
    return comm_cls


def _replica_main(rank: int, config_data: dict, conn: Any, init_method: str | None) -> None:
    """A replica: a plain engine, or with ``init_method`` (expert parallelism) one of a world stepping in lockstep."""
    config = config_class().model_validate(config_data)
    if torch.cuda.is_available() and config.model.device in ("auto", "cuda"):
        torch.cuda.set_device(rank % torch.cuda.device_count())
    tasks: dict[int, asyncio.Task] = {}
    try:
        comm_cls = _join_replicas(config, rank, init_method) if init_method else None
        engine = LLMEngine(config)
    except Exception as exc:  # noqa: BLE001 - reported to the front, which fails the start with it
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    view = engine.view
    conn.send(("ready", view.tokenizer, view.vocab_size, view.max_model_len, dict(view.selected),
               view.sampler_features, view.supported_tasks))
    asyncio.run(_serve(LockstepEngine(engine, tasks) if comm_cls else AsyncEngine(engine), conn, tasks))
    if comm_cls:
        distributed.destroy_parallel(comm_cls)


async def _serve(engine: AsyncEngine, conn: Any, tasks: dict[int, asyncio.Task]) -> None:
    """Run the front's commands: ("add", key, requests), ("abort", key), ("hear", number) (expert parallelism),
    ("shutdown",). ``tasks``: the calls running, by key."""
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue = asyncio.Queue()

    def read() -> None:
        try:
            while True:
                message = conn.recv()
                loop.call_soon_threadsafe(commands.put_nowait, message)
        except (EOFError, OSError):  # the front is gone
            loop.call_soon_threadsafe(commands.put_nowait, ("shutdown",))

    threading.Thread(target=read, name="fw-replica-commands", daemon=True).start()

    async def run(key: int, requests: list) -> None:
        try:
            async for index, output in engine.generate_many(requests):
                conn.send(("output", key, index, output))
        except Exception as exc:  # noqa: BLE001 - the front raises it to the caller
            conn.send(("error", key, exc))

    async def report() -> None:
        while True:
            lockstep = {"rounds": engine.rounds, "dummy_steps": engine.dummy_steps} \
                if isinstance(engine, LockstepEngine) else {}
            conn.send(("stats", ReplicaStats(**vars(engine.stats()), **lockstep)))
            await asyncio.sleep(STATS_INTERVAL_S)

    reporter = asyncio.create_task(report())
    while (command := await commands.get())[0] != "shutdown":
        if command[0] == "add":
            task = tasks[command[1]] = asyncio.create_task(run(command[1], command[2]))
            # Even if cancelled before it starts: a lockstep replica counts the calls in ``tasks`` as work.
            task.add_done_callback(lambda _, key=command[1]: tasks.pop(key, None))
        elif command[0] == "hear":
            engine.hear(command[1])
        elif command[0] == "abort" and command[1] in tasks:
            tasks[command[1]].cancel()  # generate_many's own clean-up aborts the requests
    reporter.cancel()
    for task in list(tasks.values()):
        task.cancel()
    await asyncio.gather(reporter, *tasks.values(), return_exceptions=True)
    engine.shutdown()


# --- the front ----------------------------------------------------------------------------------------------------


class Replica:
    """The front's view of one replica: its pipe, load, reports and the prompts it was sent."""

    def __init__(self, rank: int, process: mp.Process, conn: Any) -> None:
        self.rank, self.process, self.conn = rank, process, conn
        self.alive = True
        self.in_flight = 0  # generate_many calls routed here and not finished
        self.routed = 0  # requests routed here, ever
        self.keys: set[int] = set()  # the generate_many calls it runs
        self.stats = ReplicaStats()
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self._send_lock = threading.Lock()

    def send(self, message: tuple) -> None:
        with self._send_lock:  # event loop threads of several servers' callers
            self.conn.send(message)

    def matched(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt this replica was sent before."""
        n = 0
        while n < len(hashes) and hashes[n] in self.blocks:
            n += 1
        return n

    def remember(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > REMEMBERED_BLOCKS:
            self.blocks.popitem(last=False)


def prompt_block_hashes(prompt: PromptType, block_size: int) -> list[int]:
    """The full blocks of a token prompt, chained as the prefix cache chains them (none for a text prompt)."""
    if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
        return []
    ids, salt = prompt["prompt_token_ids"], prompt.get("cache_salt")
    return block_hash_chain(ids[: len(ids) // block_size * block_size], block_size, (salt,) if salt else ())


class DataParallelEngine:
    """An ``EngineClient`` over N replicas: each call runs on one, chosen by cached prefix and load."""

    def __init__(self, config: FwConfig) -> None:
        n = config.parallel.data_parallel_size
        data = picklable(config)
        # Expert parallelism: the replicas are one world, stepping in lockstep; otherwise each is a plain engine.
        self.lockstep = config.parallel.enable_expert_parallel
        init_method = f"tcp://127.0.0.1:{distributed.free_port()}" if self.lockstep else None
        if not self.lockstep:
            data["parallel"]["data_parallel_size"] = 1
        self.block_size = config.cache.block_size
        ctx = mp.get_context("spawn")
        self.replicas: list[Replica] = []
        for rank in range(n):
            ours, theirs = ctx.Pipe()
            process = ctx.Process(
                target=_replica_main, args=(rank, data, theirs, init_method), name=f"fw-dp-{rank}", daemon=True
            )
            process.start()
            self.replicas.append(Replica(rank, process, ours))
        ready = []
        for replica in self.replicas:
            message = replica.conn.recv() if replica.conn.poll(START_TIMEOUT_S) else ("failed", "no answer")
            if message[0] != "ready":
                self.shutdown()
                raise EngineError(f"data-parallel replica {replica.rank} did not start: {message[1]}")
            ready.append(message)
        tokenizer, vocab_size, max_model_len, selected, sampler_features, supported_tasks = ready[0][1:]
        self.view = EngineView(config, tokenizer, vocab_size, max_model_len, MappingProxyType(selected),
                               sampler_features, supported_tasks)
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, Outbox]] = {}
        self._keys = itertools.count()
        self._numbers = itertools.count(1)  # lockstep: the requests every replica hears of, in order
        self._telling = threading.Lock()
        for replica in self.replicas:
            threading.Thread(target=self._read, args=(replica,), name=f"fw-dp-{replica.rank}-out", daemon=True).start()

    def _read(self, replica: Replica) -> None:
        """Deliver one replica's outputs and reports; if it dies, fail what it was running."""
        try:
            while True:
                message = replica.conn.recv()
                if message[0] == "stats":
                    replica.stats = message[1]
                    continue
                # ("output", key, index, output) or ("error", key, exception)
                index, item = (message[2], message[3]) if message[0] == "output" else (-1, message[2])
                self._deliver(message[1], index, item)
        except (EOFError, OSError):
            pass
        replica.alive = False
        log.error("data-parallel replica %d exited", replica.rank)
        for key in list(replica.keys):
            self._deliver(key, -1, EngineError(f"data-parallel replica {replica.rank} exited"))

    def _deliver(self, key: int, index: int, item: RequestOutput | Exception) -> None:
        target = self._streams.get(key)
        if target is not None:
            target[0].call_soon_threadsafe(target[1].put, index, item)

    def pick(self, hashes: Sequence[int]) -> Replica:
        alive = [r for r in self.replicas if r.alive]
        if not alive:
            raise EngineError("no data-parallel replica is running")
        least = min(alive, key=lambda r: r.in_flight)
        matched, warm = max(((r.matched(hashes), r) for r in alive), key=lambda m: (m[0], -m[1].in_flight))
        return warm if matched and warm.in_flight <= least.in_flight + BALANCE else least

    async def generate_many(self, requests: Sequence[Submission]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """As ``AsyncEngine.generate_many``, on one replica: all of a call's requests share their prompts' fate."""
        hashes = prompt_block_hashes(requests[0][0], self.block_size) if requests else []
        replica = self.pick(hashes)
        replica.remember(hashes)
        loop, outbox = asyncio.get_running_loop(), Outbox()
        key = next(self._keys)
        self._streams[key] = (loop, outbox)
        replica.keys.add(key)
        replica.in_flight += 1
        replica.routed += len(requests)
        pending = set(range(len(requests)))
        try:
            replica.send(("add", key, list(requests)))
            if self.lockstep:
                self._tell_all()
            while pending:
                for index, item in await outbox.take():
                    if isinstance(item, Exception):
                        raise item
                    if item.finished:
                        pending.discard(index)
                    yield index, item
        finally:
            self._streams.pop(key, None)
            replica.keys.discard(key)
            replica.in_flight -= 1
            if pending and replica.alive:
                replica.send(("abort", key))

    def stats(self) -> EngineStats:
        """Each replica's stats as it last reported them (every ``STATS_INTERVAL_S``): by rank, and summed (the
        KV-cache usage averaged)."""
        replicas = tuple(replace(r.stats, rank=r.rank, routed=r.routed) for r in self.replicas)
        return EngineStats(
            running=sum(r.running for r in replicas),
            waiting=sum(r.waiting for r in replicas),
            kv_cache_usage=sum(r.kv_cache_usage for r in replicas) / len(replicas),
            prefix_cache_queries=sum(r.prefix_cache_queries for r in replicas),
            prefix_cache_hits=sum(r.prefix_cache_hits for r in replicas),
            replicas=replicas,
        )

    def has_unfinished_requests(self) -> bool:
        return any(r.in_flight for r in self.replicas)

    def _tell_all(self) -> None:
        """Lockstep: every replica hears of the call just sent, each in the same order (module doc)."""
        with self._telling:
            number = next(self._numbers)
            for replica in self.replicas:
                if replica.alive:
                    replica.send(("hear", number))

    def shutdown(self) -> None:
        for replica in self.replicas:
            if replica.process.is_alive():
                with contextlib.suppress(OSError):  # it is exiting on its own
                    replica.send(("shutdown",))
        for replica in self.replicas:
            replica.process.join(timeout=30)
            if replica.process.is_alive():
                replica.process.kill()
