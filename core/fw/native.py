"""Native CPU kernels: C++ sources that plugins ship, built on first use on the machine that runs them.

``torch.utils.cpp_extension`` compiles a source file once per machine (about
10 s; cached under ``TORCH_EXTENSIONS_DIR``, rebuilt when the source changes)
with ``-march=native``, so the kernels use whatever vector units the CPU has.
Its operators then live under ``torch.ops.<name>``. Without a compiler (or
with ``FW_NATIVE=0``) ``load`` returns False and logs why once: every caller
keeps a pure-torch path, which is also the reference its tests compare with.
Shared helpers for kernels live in ``fw/csrc/fw_cpu.h``, on every build's include path.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

# fw_cpu.h (bf16 conversions, a vector exp) for every kernel, the plugins' included.
INCLUDE = Path(__file__).parent / "csrc"


_build_seconds = 0.0


def build_seconds() -> float:
    """Seconds this process has spent in first uses of ``load`` (compiling, or loading a cached build): the
    engine subtracts them from the forward pass it times."""
    return _build_seconds


@functools.cache
def load(name: str, source: Path) -> bool:
    """Build (or reuse) ``source`` as the operator library ``torch.ops.<name>``; True when it is usable."""
    if os.environ.get("FW_NATIVE", "1") == "0":
        return False
    global _build_seconds
    start = time.perf_counter()
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name=name,
            sources=[str(source)],
            extra_include_paths=[str(INCLUDE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as exc:  # no compiler, no ninja, an unsupported toolchain: fall back, never fail the engine
        logger.warning("native kernels %s unavailable, using the torch path: %s", name, exc)
        return False
    finally:
        _build_seconds += time.perf_counter() - start
    return True
