"""Kernel choice by measurement: which implementation of a hot operation runs, per CPU and shape.

A kernel that wins on one CPU can lose 2x on the next (fw's AVX512-BF16
dense kernel against oneDNN's AMX path; bf16 ``F.linear`` against widening to
float32 on a CPU without bf16 arithmetic), so nothing here is chosen by
assumption. An ``Operation`` (``dense.linear``, ``gguf.linear``, ...) holds
``Candidate`` implementations, which the core and plugins ``register``. The
first time a layer of a new shape loads, ``Operation.select`` times every
candidate that supports it on a few row counts (decode to prefill sizes) and
keeps the fastest for each. Each timed call finds its prepared weight evicted
from the caches, as a step finds it: a model's weights outgrow the caches
between two uses, and timed warm (the previous call's copy in L2), an AMX Xeon
chose kernels 1.3-1.6x slower on weights streamed from memory. The choice is
cached on disk, keyed by CPU model, CPU flags, thread count and library
versions, so later starts time nothing.
A choice remembers which candidates it was made among: one made while fewer
could run (``FW_NATIVE=0``, a native build that failed) is timed again once
more can. It also remembers the native libraries loaded then (``fw.sdk.native``,
by the digest of their sources): one timed on an older version of a kernel
is timed again.

- ``FW_KERNELS=NAME`` forces candidate NAME in every operation that has one;
  ``FW_KERNELS=dense.linear=torch,gguf.linear=fw`` forces per operation.
- ``FW_KERNEL_CACHE=PATH`` moves the cache file (default
  ``$XDG_CACHE_HOME/fw/kernels.json``); a corrupt file is ignored and rebuilt.

The choices an engine makes while loading a model, or in its first steps, are
reported as one line at INFO (``choosing``), each one's timings at DEBUG; on a
terminal a progress line shows meanwhile.

A candidate prepares the weight once (its layout: a packed copy, a float32
copy, or the weight as is) and then runs ``run(state, x, *args)``. Where two
row classes prefer different layouts, the layer keeps a second copy only if
it is at least ``LAYOUT_GAIN`` times faster there: memory is not spent for noise.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import platform
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fw.sdk import native, native_ops

logger = logging.getLogger(__name__)

ROWS = (1, 8, 32, 256)  # rows of x the candidates are timed on: decode, small batch, batch, prefill chunk
LAYOUT_GAIN = 1.25  # a second weight layout must be this much faster for its row class
# Decode steps of up to this many rows are captured and replayed without Python (fw.decode_graph, which says when):
# in those row classes a candidate a trace cannot hold must be LAYOUT_GAIN faster, as the step would run eagerly.
CAPTURED_ROWS = 32
MEASURE_S = 0.02  # time per candidate and row class (at least one call, at most MAX_CALLS)
MAX_CALLS = 5
SLOWER_CUTOFF = 3.0  # a candidate this much slower than the best on its first call is not timed again
BUSY_SHARE = 0.1  # a choice timed while other processes took more of the CPUs than this is not cached
CACHE_VERSION = 3  # 2: each choice records the candidates it was made among; 3: timed on evicted weights
_clock = time.perf_counter  # tests replace it


def importable(module: str) -> bool:
    """Whether ``module`` is installed (for a candidate's ``supports``), found without importing it."""
    return importlib.util.find_spec(module) is not None


def _identity(weight: Any) -> Any:
    return weight


def _always(key: tuple) -> bool:
    return True


@dataclass(frozen=True)
class Candidate:
    """One implementation of an operation.

    ``supports(key)`` says whether it runs the shape (and dtype, device) ``key`` on this machine;
    ``prepare(weight)`` builds what ``run(state, x, *args)`` reads, once per layer; candidates with the
    same ``layout`` share that state. ``traceable=False``: a captured decode step (``torch.jit.trace``) cannot
    hold its state (an opaque tensor, such as oneDNN's prepacked weight).
    """

    name: str
    run: Callable[..., torch.Tensor]
    prepare: Callable[[Any], Any] = _identity
    layout: str = "plain"
    supports: Callable[[tuple], bool] = _always
    traceable: bool = True


@dataclass
class Selection:
    """An operation's choice for one layer: the candidate and prepared state per row class."""

    op: str
    key: tuple
    names: tuple[str, ...]  # per row class
    among: tuple[str, ...]  # the candidates that could run when it was made
    _bounds: list[float] = field(repr=False)
    _entries: list[tuple[Callable[..., torch.Tensor], Any]] = field(repr=False)

    def __call__(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        run, state = self._entries[self._row_class(x.numel() // x.shape[-1])]
        return run(state, x, *args)

    def name_for(self, rows: int) -> str:
        """The candidate that runs an input of ``rows`` rows."""
        return self.names[self._row_class(rows)]

    def _row_class(self, rows: int) -> int:
        return bisect.bisect_left(self._bounds, rows)

    def state(self, name: str) -> Any | None:
        """The state candidate ``name`` reads, where it runs some row class."""
        return next((state for n, (_, state) in zip(self.names, self._entries, strict=True) if n == name), None)

    def replace(self, other: Selection) -> None:
        """Runs ``other``'s choice from now on: the layers that hold this selection keep holding it."""
        self.names, self.among, self._entries = other.names, other.among, other._entries

    @property
    def states(self) -> list[Any]:
        """Each distinct prepared state once (the layer's memory for this weight)."""
        seen: dict[int, Any] = {}
        for _, state in self._entries:
            seen.setdefault(id(state), state)
        return list(seen.values())


class Operation:
    """A hot operation and its candidates. ``reference`` names the candidate every other one is tested
    against; ``rows`` are the row classes timed (an input goes to the nearest class, geometrically)."""

    def __init__(self, name: str, reference: str, rows: Sequence[int] = ROWS) -> None:
        self.name = name
        self.reference = reference
        self.rows = tuple(rows)
        self.candidates: dict[str, Candidate] = {}
        self._bounds = [math.sqrt(a * b) for a, b in zip(self.rows, self.rows[1:], strict=False)]
        _OPERATIONS[name] = self

    def register(self, candidate: Candidate) -> Candidate:
        if candidate.name in self.candidates:
            raise ValueError(f"{self.name}: a candidate named {candidate.name!r} is registered already")
        self.candidates[candidate.name] = candidate
        return candidate

    def supported(self, key: tuple) -> list[Candidate]:
        return [c for c in self.candidates.values() if c.supports(key)]

    def select(self, key: tuple, weight: Any, sample: Callable[[int], tuple]) -> Selection:
        """The fastest supported candidate per row class for ``key``: forced, cached, or timed now on
        ``sample(rows)`` (the arguments after the state) and then cached."""
        usable = {c.name: c for c in self.supported(key)}
        if not usable:
            raise RuntimeError(f"{self.name}: no candidate supports {key} (registered: {', '.join(self.candidates)})")
        forced = _forced(self.name, self.candidates)
        if forced is not None:
            if forced not in usable and native.building():  # what is forced may be what builds: it must run
                native.wait()
                usable = {c.name: c for c in self.supported(key)}
            if forced not in usable:
                raise RuntimeError(f"FW_KERNELS forces {self.name}={forced}, which cannot run {key} here "
                                   f"(can: {', '.join(usable)})")
            names = (forced,) * len(self.rows)
        else:
            names = _UNCACHED.get((self.name, key)) or _CACHE.lookup(self.name, key, usable)
            burst = getattr(_bursts, "current", None)
            if names is None or len(names) != len(self.rows):
                if burst is not None:
                    burst.progress(self.name)
                before = _cpu_times()
                names = self._measure(key, weight, sample, usable)
                others = _others_share(before, _cpu_times()) if len(usable) > 1 else 0.0  # nothing timed
                if others <= BUSY_SHARE and not native.building():
                    _CACHE.store(self.name, key, names, usable)
                else:  # kept for this process, so that its layers of one shape still agree
                    _UNCACHED[(self.name, key)] = names
                    if others > BUSY_SHARE:
                        logger.debug("%s %s: other processes used %.0f%% of the CPUs while fw timed kernels; the "
                                     "choice serves this process only and is measured again next time", self.name,
                                     key, 100 * others)
                if burst is not None:
                    burst.timed(self.name, names, others if others > BUSY_SHARE else None)
            elif burst is not None:
                burst.reused += 1
        selection = self._build(key, weight, names, usable)
        if forced is None and native.building():  # chosen again when what builds lands (refresh)
            _PROVISIONAL.append(_Provisional(self, key, weight, sample, selection))
        return selection

    def _build(self, key: tuple, weight: Any, names: Sequence[str], usable: dict[str, Candidate]) -> Selection:
        states: dict[str, Any] = {}
        entries = []
        for name in names:
            c = usable[name]
            if c.layout not in states:
                states[c.layout] = c.prepare(weight)
            entries.append((c.run, states[c.layout]))
        selection = Selection(self.name, key, tuple(names), tuple(sorted(usable)), self._bounds, entries)
        _CHOSEN[(self.name, key)] = selection.names
        return selection

    def _measure(self, key: tuple, weight: Any, sample: Callable[[int], tuple],
                 usable: dict[str, Candidate]) -> tuple[str, ...]:
        if len(usable) == 1:
            return (next(iter(usable)),) * len(self.rows)
        states: dict[str, Any] = {}
        for c in usable.values():
            if c.layout not in states:
                states[c.layout] = c.prepare(weight)
        # Each tensor once: an LM head's state holds its tiles twice (``dense.ArgmaxHead``), 272 MB for Qwen2-0.5B.
        weights = {layout: list({id(t): t for t in _tensors(state)}.values()) for layout, state in states.items()}
        with torch.inference_mode():
            times = [_race({n: functools.partial(c.run, states[c.layout], *sample(rows)) for n, c in usable.items()},
                           {n: functools.partial(native_ops.evict, weights[c.layout]) for n, c in usable.items()})
                     for rows in self.rows]
        names = _fewest_layouts(times, usable, self.rows)
        logger.debug("%s %s: chose %s (%s)", self.name, key, "/".join(names), "; ".join(
            f"{r} rows: " + ", ".join(f"{n} {t * 1e6:.0f} us" for n, t in sorted(ts.items(), key=lambda i: i[1]))
            for r, ts in zip(self.rows, times, strict=True)))
        return names


class _Burst:
    """The choices made within one ``choosing``: what its summary line reports."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.start = time.perf_counter()
        self.reused = 0  # choices not timed: found in the cache, or made earlier by this process
        self.chosen: dict[str, Counter[str]] = {}  # op -> how often each per-row-class choice was timed
        self.busy: list[float] = []  # other processes' CPU share during each choice timed on a busy machine
        self.shown = False  # whether a progress line is on the terminal

    def progress(self, op: str) -> None:
        """A line rewritten in place on a terminal: the first start can time for many seconds."""
        if logger.isEnabledFor(logging.INFO) and sys.stderr.isatty():
            done = sum(sum(c.values()) for c in self.chosen.values())
            sys.stderr.write(f"\r\x1b[Kfw: timing kernels for this CPU ({self.what}): {op}, {done} shapes done, "
                             f"{time.perf_counter() - self.start:.0f} s")
            sys.stderr.flush()
            self.shown = True

    def timed(self, op: str, names: tuple[str, ...], busy: float | None) -> None:
        self.chosen.setdefault(op, Counter())["/".join(names)] += 1
        if busy is not None:
            self.busy.append(busy)

    def report(self) -> None:
        if self.shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
        if not self.chosen:
            return
        chosen = sum(sum(c.values()) for c in self.chosen.values())
        ops = "; ".join(f"{op} " + ", ".join(f"{names} x{n}" for names, n in counts.most_common())
                        + f" (rows {'/'.join(map(str, _OPERATIONS[op].rows))})" for op, counts in self.chosen.items())
        busy = (f"; {len(self.busy)} timed while other processes used up to {100 * max(self.busy):.0f}% of the CPUs "
                "serve this process only" if self.busy else "")
        logger.info("fw: kernel choice (%s): %d layers, %d shapes chosen in %.1f s: %s%s (each timing: "
                    "FW_LOG_LEVEL=DEBUG)", self.what, chosen + self.reused, chosen, time.perf_counter() - self.start,
                    ops, busy)


_bursts = threading.local()


@contextlib.contextmanager
def choosing(what: str) -> Iterator[None]:
    """Reports the kernel choices made inside as one INFO line at the end (``what``: the phase, e.g. "loading the
    model"), with a progress line on a terminal meanwhile; nothing when every choice came from the cache. Nested
    uses report in the outermost."""
    if getattr(_bursts, "current", None) is not None:
        yield
        return
    _bursts.current = burst = _Burst(what)
    try:
        yield
    finally:
        _bursts.current = None
        burst.report()


def _tensors(state: Any, depth: int = 0) -> list[torch.Tensor]:
    """The CPU tensors a prepared state holds: itself, or those of its items or attributes, two levels down."""
    if isinstance(state, torch.Tensor):
        return [state] if state.device.type == "cpu" else []
    if depth == 2:
        return []
    if isinstance(state, (tuple, list)):
        return [t for item in state for t in _tensors(item, depth + 1)]
    if hasattr(state, "__dict__") and not isinstance(state, type):
        return [t for value in vars(state).values() for t in _tensors(value, depth + 1)]
    return []


def _race(calls: dict[str, Callable[[], Any]], before: dict[str, Callable[[], Any]] | None = None) -> dict[str, float]:
    """Each call's fastest time, after a warm-up call; ``before[name]()`` runs, untimed, before each timed call
    (the weights evicted from the caches). One far slower than the best in the first round is not run again.
    Rounds interleave the calls, so a busy machine slows them alike. A call that fails its warm-up is left out: a
    candidate this machine cannot run after all (a library's shape or driver limits) is never chosen."""
    for name, call in list(calls.items()):
        try:
            call()
        except Exception as exc:
            logger.warning("kernel candidate %s failed here and is not chosen: %s", name, exc)
            del calls[name]
    before = before or {}
    fastest = {name: _once(call, before.get(name)) for name, call in calls.items()}
    best = min(fastest.values())
    racing = [name for name, t in fastest.items() if t <= SLOWER_CUTOFF * best]
    spent = sum(fastest.values())
    for _ in range(MAX_CALLS - 1):
        if spent >= MEASURE_S * len(racing):
            break
        for name in racing:
            took = _once(calls[name], before.get(name))
            fastest[name], spent = min(fastest[name], took), spent + took
    return fastest


def _once(call: Callable[[], Any], before: Callable[[], Any] | None = None) -> float:
    if before is not None:
        before()
    start = _clock()
    call()
    return _clock() - start


def _cpu_times() -> tuple[int, int, float] | None:
    """(busy, total) jiffies of the whole machine and this process's CPU seconds; None off Linux."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    own = os.times()
    return sum(fields) - idle, sum(fields), own.user + own.system


def _others_share(before: tuple[int, int, float] | None, after: tuple[int, int, float] | None) -> float:
    """The share of the machine's CPU time that other processes took between two ``_cpu_times``: a timing
    taken then says more about them than about the kernels (on 2 cores one busy neighbour reversed choices)."""
    if before is None or after is None or after[1] <= before[1]:
        return 0.0
    ours = (after[2] - before[2]) * os.sysconf("SC_CLK_TCK")
    return max(0.0, (after[0] - before[0] - ours) / (after[1] - before[1]))


def _fewest_layouts(times: list[dict[str, float]], usable: dict[str, Candidate], rows: Sequence[int]) -> tuple[str, ...]:
    """Per row class the fastest candidate, but within the layouts already kept unless another is
    ``LAYOUT_GAIN`` times faster. The decode class (first) chooses freely: it runs most steps. Up to
    ``CAPTURED_ROWS`` rows, among the traceable candidates unless another is ``LAYOUT_GAIN`` times faster."""
    kept: set[str] = set()
    names = []
    for count, row_times in zip(rows, times, strict=True):
        traceable = {n: t for n, t in row_times.items() if usable[n].traceable}
        if count <= CAPTURED_ROWS and traceable and min(traceable.values()) <= LAYOUT_GAIN * min(row_times.values()):
            row_times = traceable
        fastest = min(row_times, key=row_times.__getitem__)
        in_kept = [n for n in row_times if usable[n].layout in kept]
        if in_kept:
            best_kept = min(in_kept, key=row_times.__getitem__)
            if row_times[best_kept] <= LAYOUT_GAIN * row_times[fastest]:
                fastest = best_kept
        kept.add(usable[fastest].layout)
        names.append(fastest)
    return tuple(names)


def _forced(op: str, candidates: dict[str, Candidate]) -> str | None:
    """FW_KERNELS' choice for ``op``: ``op=name`` applies to that operation; a bare name to every operation
    that has a candidate of that name."""
    spec = os.environ.get("FW_KERNELS", "").strip()
    if not spec:
        return None
    for item in spec.split(","):
        target, sep, name = item.strip().rpartition("=")
        if sep and target == op:
            return name
        if not sep and name in candidates:
            return name
    return None


@functools.cache
def _cpu() -> tuple[str, str]:
    """The CPU's model name and its sorted flags (``/proc/cpuinfo``; Linux on x86 and Arm)."""
    model, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = (part.strip() for part in line.partition(":"))
            if name == "model name" and not model:
                model = value
            elif name in ("flags", "Features") and not flags:
                flags = value
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), " ".join(sorted(flags.split()))


def machine() -> dict[str, Any]:
    """What a kernel's speed depends on besides the shape: the cache key and ``fw bench``'s header."""
    model, flags = _cpu()
    # The installed distribution's version: the SDK reads nothing of fw outside itself and the interfaces.
    return {"cpu": model, "flags": flags, "threads": native.threads(), "torch": torch.__version__,
            "fw": importlib.metadata.version("fw-core")}


def relevant_flags(flags: str) -> str:
    """The vector and matrix extensions among ``flags``: what decides between kernels."""
    prefixes, parts = ("avx", "amx", "fma", "f16c", "sve", "neon", "asimd"), ("vnni", "bf16", "fp16", "i8mm")
    return " ".join(f for f in flags.split() if f.startswith(prefixes) or any(p in f for p in parts))


class _Cache:
    """Choices on disk: ``{"version", "machines": {fingerprint: {"machine": ..., "choices": {op: {key: choice}}}}}``,
    a choice being ``{"names": per row class, "among": the candidates that could run}``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, Any] | None = None
        self._path: Path | None = None

    @property
    def path(self) -> Path:
        env = os.environ.get("FW_KERNEL_CACHE")
        if env:
            return Path(env)
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base) / "fw" / "kernels.json"

    def _machine_entry(self) -> dict[str, Any]:
        path = self.path
        if self._data is None or self._path != path:
            self._path, self._data = path, self._read(path)
        info = machine()
        fingerprint = json.dumps(info, sort_keys=True)
        return self._data["machines"].setdefault(fingerprint, {"machine": info, "choices": {}})

    @staticmethod
    def _read(path: Path) -> dict[str, Any]:
        try:
            data = json.loads(path.read_text())
            if data.get("version") == CACHE_VERSION and isinstance(data.get("machines"), dict):
                return data
            logger.warning("kernel cache %s is from another fw version; rebuilding it", path)
        except FileNotFoundError:
            pass
        except (OSError, ValueError, AttributeError) as exc:
            logger.warning("kernel cache %s is unreadable (%s); rebuilding it", path, exc)
        return {"version": CACHE_VERSION, "machines": {}}

    def lookup(self, op: str, key: tuple, usable: dict[str, Any]) -> tuple[str, ...] | None:
        """The cached choice, if it was made among exactly the candidates that can run now, and no native library
        loaded both then and now has changed since (a kernel edited within one fw version is timed again)."""
        with self._lock:
            choice = self._machine_entry()["choices"].get(op, {}).get(repr(key))
        if not isinstance(choice, dict) or choice.get("among") != sorted(usable):
            return None
        then, now = choice.get("builds", {}), native.builds()
        if not isinstance(then, dict) or any(now.get(lib, digest) != digest for lib, digest in then.items()):
            return None
        names = choice.get("names")
        return tuple(names) if isinstance(names, list) and all(isinstance(n, str) for n in names) else None

    def store(self, op: str, key: tuple, names: tuple[str, ...], usable: dict[str, Any]) -> None:
        with self._lock:
            self._machine_entry()["choices"].setdefault(op, {})[repr(key)] = {
                "names": list(names), "among": sorted(usable), "builds": native.builds()}
            path = self.path
            try:  # atomically: another process (a tensor-parallel rank) may read it meanwhile
                path.parent.mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
                    json.dump(self._data, f, indent=1)
                os.replace(f.name, path)
            except OSError as exc:
                logger.warning("cannot write the kernel cache %s: %s", path, exc)


@dataclass(frozen=True, eq=False)
class _Provisional:
    """A selection made while native libraries built in the background, and what ``select`` made it from."""

    op: Operation
    key: tuple
    weight: Any
    sample: Callable[[int], tuple]
    selection: Selection


_OPERATIONS: dict[str, Operation] = {}
_CHOSEN: dict[tuple[str, tuple], tuple[str, ...]] = {}
_UNCACHED: dict[tuple[str, tuple], tuple[str, ...]] = {}  # choices timed on a busy machine, or while kernels built
_PROVISIONAL: list[_Provisional] = []
_CACHE = _Cache()


def refresh() -> bool:
    """Loads the native libraries built in the background since the last call (``native.poll``) and chooses again,
    among the candidates that run now, wherever a selection was made without them. True when a library landed: a
    step captured before it runs the old kernels. The engine calls it between steps."""
    if not native.poll():
        return False
    provisional = list(_PROVISIONAL)
    _PROVISIONAL.clear()
    stale = [p for p in provisional if tuple(sorted(c.name for c in p.op.supported(p.key))) != p.selection.among]
    for p in stale:  # first, so that layers of one shape time it once, together
        _UNCACHED.pop((p.op.name, p.key), None)
    with choosing("native kernels built in the background"):
        for p in stale:
            p.selection.replace(p.op.select(p.key, p.weight, p.sample))
    if native.building():
        _PROVISIONAL.extend(p for p in provisional if p not in stale)
    return True


def operations() -> dict[str, Operation]:
    """Every operation defined so far (the core's, and those of the plugins imported)."""
    return dict(_OPERATIONS)


def untraceable(module: torch.nn.Module, rows: int) -> list[str]:
    """``op/candidate`` of each choice held under ``module`` (by a layer, its weights or its quant method) that runs
    inputs of ``rows`` rows with a candidate a trace cannot hold: a decode step of that many tokens runs eagerly."""
    found: set[str] = set()
    for layer in module.modules():
        for held in (*vars(layer).values(), *layer._parameters.values(), *layer._buffers.values()):
            selection = held if isinstance(held, Selection) else getattr(held, "kernel", None)
            if isinstance(selection, Selection):
                name = selection.name_for(rows)
                if not _OPERATIONS[selection.op].candidates[name].traceable:
                    found.add(f"{selection.op}/{name}")
    return sorted(found)


def chosen() -> dict[str, dict[str, dict[int, str]]]:
    """What this process selected: ``{op: {key: {rows: candidate}}}``, for ``fw bench`` and the start-up log."""
    out: dict[str, dict[str, dict[int, str]]] = {}
    for (op, key), names in _CHOSEN.items():
        out.setdefault(op, {})[repr(key)] = dict(zip(_OPERATIONS[op].rows, names, strict=True))
    return out
