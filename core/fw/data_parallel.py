"""Data parallelism behind one server: ``fw serve -dp N`` runs N engine replicas, each in its own process with
its own scheduler and KV cache, and routes every request to one of them.

The server talks to a ``DataParallelEngine`` as it talks to one ``AsyncEngine`` (``generate_many``,
``shutdown``). Each replica process runs an ``AsyncEngine`` over its own ``LLMEngine`` (on a GPU machine, device
``cuda:<replica>``), so a request that fails a step fails there exactly as with one engine; the front forwards
requests, outputs and aborts over a pipe per replica.

Routing: the replica that holds the longest cached prefix of the prompt, as far as the front remembers the prompts
it sent there (their block hashes, chained as the prefix cache chains them), unless it carries more than
``BALANCE`` requests above the least loaded replica; otherwise, and for a prompt no replica has seen, the least
loaded. Each replica reports its queues, KV-cache use and prefix-cache counts every ``STATS_INTERVAL_S``; /metrics
shows them per replica (label ``engine``, as vLLM does), with the requests routed to each.

With ``--enable-expert-parallel`` the replicas are one torch.distributed world whose expert-parallel group spans
them all, as vLLM's does: each holds its share of every MoE layer's experts, and each forward pass's dispatch and
combine are collectives over every replica. So the replicas step in lockstep (``LockstepEngine``): in rounds, each
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
import os
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fw import distributed, plugins
from fw.async_engine import AsyncEngine, Outbox
from fw.config import FwConfig, config_class, picklable
from fw.engine import EngineError, LLMEngine
from fw.inputs import PromptType
from fw.kv_cache import block_hash_chain
from fw.layers.moe import FusedMoE
from fw.outputs import RequestOutput
from fw.platform import detect
from fw.sampling_params import SamplingParams

log = logging.getLogger("fw")

BALANCE = 4  # requests in flight a cache-warm replica may carry above the least loaded one and still be chosen
REMEMBERED_BLOCKS = 1 << 16  # per replica: block hashes of the prompts routed there, least recent forgotten
STATS_INTERVAL_S = 0.5
START_TIMEOUT_S = 600.0


@dataclass
class ReplicaStats:
    """What a replica reports of itself."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    rounds: int = 0  # lockstep rounds run (expert parallelism only)
    dummy_steps: int = 0  # of those, forward passes of other replicas this one joined without a batch


def _snapshot(engine: LLMEngine) -> ReplicaStats:
    sched, kv = engine.scheduler, engine.kv
    return ReplicaStats(len(sched.running), len(sched.waiting) + len(sched.waiting_for_kv), kv.usage(),
                        kv.prefix_cache_queries, kv.prefix_cache_hits)


# --- the replica process ----------------------------------------------------------------------------------------


def _join_replicas(config: FwConfig, rank: int, init_method: str) -> type:
    """Join the replicas' world (expert parallelism): its data- and expert-parallel groups span every replica."""
    spec, comm_cls = plugins.load_driver("comm", config.comm.name)
    layout = distributed.ParallelLayout(data_parallel_size=config.parallel.data_parallel_size, expert_parallel=True)
    device, options = detect(config.model.device).device, spec.parse_options(config.comm.options)
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
    conn.send(("ready", engine.tokenizer, engine.vocab_size, engine.max_model_len))
    asyncio.run(_serve(LockstepEngine(engine, tasks) if comm_cls else AsyncEngine(engine), conn, tasks))
    if comm_cls:
        distributed.destroy_parallel(comm_cls)


IDLE, WORK, FORWARD = 0, 1, 2  # a replica in a round: no requests; requests, but no batch now; a forward pass now


class LockstepEngine(AsyncEngine):
    """A replica whose forward passes need every replica (module doc): it steps in rounds with the others.

    A round opens with an all-reduce of each replica's state, the newest request it has heard of and whether it
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
        forward = engine.executor.execute

        def execute(inputs):
            self._round(forward=True)
            return forward(inputs)

        engine.executor.execute = execute  # each forward pass of this replica's opens a round
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
            stats = await engine.run(_snapshot)
            if isinstance(engine, LockstepEngine):
                stats.rounds, stats.dummy_steps = engine.rounds, engine.dummy_steps
            conn.send(("stats", stats))
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


class FrontInfo:
    """What the server reads of "the engine": the replicas' tokenizer and limits, and whether any works."""

    def __init__(self, front: DataParallelEngine, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.front, self.tokenizer, self.vocab_size, self.max_model_len = front, tokenizer, vocab_size, max_model_len

    @property
    def replicas(self) -> list[Replica]:
        return self.front.replicas

    def has_unfinished_requests(self) -> bool:
        return any(r.in_flight for r in self.front.replicas)


class DataParallelEngine:
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
        self.engine = FrontInfo(self, *ready[0][1:])
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

    async def generate_many(
        self, requests: Sequence[tuple[PromptType, SamplingParams, str, int]]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
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
