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
Shared helpers for kernels live in ``fw/csrc/fw_cpu.h``, on every build's include path.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

# fw_cpu.h (bf16 conversions, a vector exp) for every kernel, the plugins' included.
INCLUDE = Path(__file__).parent.parent / "csrc"


_build_seconds = 0.0
_builds: dict[str, str] = {}  # library name -> digest of the version loaded


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


@functools.cache
def load(name: str, source: Path) -> bool:
    """Build (or reuse) ``source`` as the operator library ``torch.ops.<name>``; True when it is usable."""
    if os.environ.get("FW_NATIVE", "1") == "0":
        return False
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
