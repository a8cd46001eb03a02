"""Native CPU kernels: C++ sources that plugins ship, built on first use on the machine that runs them.

``torch.utils.cpp_extension`` compiles a source file once per machine (about
10 s) with ``-march=native``, so the kernels use whatever vector units the CPU
has. Each version of a source builds in its own folder under
``TORCH_EXTENSIONS_DIR`` (named by a hash of its text and of where fw's header
and torch are installed), so two installs of fw, or two virtualenvs, on one
machine never rebuild each other's kernels or load the other's. A build killed
midway leaves torch's lock file behind, on which every later start would wait
forever; builds here hold a lock the system releases with its holder, and clear
torch's when they get it.
Its operators then live under ``torch.ops.<name>``. Without a compiler (or
with ``FW_NATIVE=0``) ``load`` returns False and logs why once: every caller
keeps a pure-torch path, which is also the reference its tests compare with.

With ``FW_NATIVE_BUILD=background`` (``fw serve`` sets it: a first start should
answer within seconds, not wait for compilers) a library not built yet builds
in a child process while ``load`` says False, so the torch paths serve, on the
cores the builds leave until they have landed; the engine calls ``poll``
between steps, which loads what has been built since, and kernel choice then
times the new candidates (``fw.sdk.kernels.refresh``).
Shared helpers for kernels live in ``fw/csrc/fw_cpu.h``, on every build's include path.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)

# fw_cpu.h (bf16 conversions, a vector exp) for every kernel, the plugins' included.
INCLUDE = Path(__file__).parent.parent / "csrc"


_build_seconds = 0.0
_builds: dict[str, str] = {}  # library name -> digest of the version loaded
_loaded: dict[str, bool] = {}  # library name -> whether ``load`` made it usable (asked per op: keyed by the name)


@dataclass
class _Build:
    """A library building in a child process (``FW_NATIVE_BUILD=background``)."""

    source: Path
    process: subprocess.Popen
    log: IO[bytes]  # the child's output: why a failed build failed


_building: dict[str, _Build] = {}
# torch's configured thread count while background builds run (None: none runs). Meanwhile torch keeps to the cores
# the compilers leave, one at least: each parallel region waits for every one of its threads to get a core (a first
# `fw serve` of the default model on two cores answered the README's question after 20-31 s at two threads, 9-10 s
# at one).
_threads: int | None = None


def _fit_threads() -> None:
    global _threads
    import torch

    if _building:
        if _threads is None:
            _threads = torch.get_num_threads()
        torch.set_num_threads(max(1, _threads - len(_building)))
    elif _threads is not None:
        torch.set_num_threads(_threads)
        _threads = None


def builds() -> dict[str, str]:
    """The native libraries this process loaded, each with the digest of its sources (``build_directory``): what
    a kernel choice was timed on."""
    return dict(_builds)


def build_seconds() -> float:
    """Seconds this process has spent in first uses of ``load`` (compiling, or loading a cached build): the
    engine subtracts them from the forward pass it times."""
    return _build_seconds


def build_directory(name: str, source: Path) -> Path:
    """Where ``source`` is built: a folder per version of it, of the shared header and of the installs."""
    import torch
    from torch.utils import cpp_extension

    # The build files name the include paths: another install's would make each rebuild the other's build.
    where = f"{INCLUDE.resolve()}\n{Path(torch.__file__).parent.resolve()}\n{torch.__version__}".encode()
    digest = hashlib.sha256(source.read_bytes() + (INCLUDE / "fw_cpu.h").read_bytes() + where).hexdigest()[:16]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    path = Path(root) / f"{name}-{digest}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load(name: str, source: Path) -> bool:
    """Build (or reuse) ``source`` as the operator library ``torch.ops.<name>``; True when it is usable. Under
    ``FW_NATIVE_BUILD=background`` False while it builds, until a ``poll`` after the build loads it."""
    usable = _loaded.get(name)
    if usable is not None:
        return usable
    if name in _building:
        return False
    if os.environ.get("FW_NATIVE", "1") == "0":
        usable = False
    elif os.environ.get("FW_NATIVE_BUILD") == "background" and not _built(name, source):
        _start_build(name, source)
        return False
    else:
        usable = _load(name, source)
    _loaded[name] = usable
    return usable


def threads() -> int:
    """torch's thread count as configured, also while background builds hold it lower."""
    import torch

    return _threads if _threads is not None else torch.get_num_threads()


def building() -> list[str]:
    """The libraries building in the background now."""
    return list(_building)


def poll() -> list[str]:
    """Loads the libraries whose background builds have finished since the last call; returns those that became
    usable. Called between engine steps, so that a step's kernels never change under it."""
    landed = []
    for name, build in list(_building.items()):
        if build.process.poll() is None:
            continue
        del _building[name]
        build.log.seek(0)
        output = build.log.read().decode(errors="replace").strip()
        build.log.close()
        if build.process.returncode == 0:
            _loaded[name] = _load(name, build.source)
        else:
            _loaded[name] = False
            logger.warning("native kernels %s unavailable, using the torch path: the build failed: %s", name,
                           output.splitlines()[-1] if output else f"exit status {build.process.returncode}")
        if _loaded[name]:
            landed.append(name)
            logger.info("native kernels %s built in the background: in use from now on", name)
    _fit_threads()  # before the caller times the kernels that landed
    return landed


def wait() -> None:
    """Waits for the background builds and loads what they built."""
    for build in list(_building.values()):
        build.process.wait()
    poll()


def _built(name: str, source: Path) -> bool:
    """Whether this version of ``source`` has been built on this machine (loading it takes a moment, not a compiler)."""
    try:
        return (build_directory(name, source) / f"{name}.so").is_file()
    except Exception:  # no build root to write: loading says why
        return True


def _start_build(name: str, source: Path) -> None:
    log = tempfile.TemporaryFile()  # noqa: SIM115 (open while the child writes; poll closes it)
    # The child builds as ``load`` does and exits; this process loads the result at a ``poll``. At the server's
    # priority: a lower one never finishes on a machine kept busy, and the torch paths would serve for good.
    code = "import sys, pathlib; from fw.sdk import native; sys.exit(0 if native.load(sys.argv[1], pathlib.Path(sys.argv[2])) else 1)"
    process = subprocess.Popen([sys.executable, "-c", code, name, str(source)], stdin=subprocess.DEVNULL,
                               stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "FW_NATIVE_BUILD": "wait"})
    _building[name] = _Build(source, process, log)
    logger.info("native kernels %s: building in the background (%s); the torch path serves until then", name,
                source.name)
    _fit_threads()


def _load(name: str, source: Path) -> bool:
    global _build_seconds
    start = time.perf_counter()
    try:
        from torch.utils import cpp_extension

        folder = build_directory(name, source)
        with open(folder / "fw.lock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            # Every builder holds this lock before torch makes its own: one found now is a dead builder's.
            (folder / "lock").unlink(missing_ok=True)
            cpp_extension.load(
                name=name,
                sources=[str(source)],
                extra_include_paths=[str(INCLUDE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
                is_python_module=False,
            )
    except Exception as exc:  # no compiler, no ninja, an unsupported toolchain: fall back, never fail the engine
        logger.warning("native kernels %s unavailable, using the torch path: %s", name, exc)
        return False
    finally:
        _build_seconds += time.perf_counter() - start
    _builds[name] = folder.name.rpartition("-")[2]
    return True
