"""Fixtures and helpers shared by every test directory (tests/ and each plugin's tests/): run the `fw` CLI in a
subprocess, a live `fw serve`, fake installed plugin distributions, the quant plugins' references."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from fw.testing.models import make_tiny_model, scratch_dir

# Kernel choices (fw.sdk.kernels) are measured afresh for this run, in every process it starts, not read from or
# written to the user's cache.
os.environ["FW_KERNEL_CACHE"] = str(scratch_dir("fw-kernels-") / "kernels.json")

# Without a GPU, Triton kernels run in Triton's interpreter; it must be on before any kernel is decorated.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent

# A pytest-xdist worker (`pytest -n 2`) shares the cores with the others: torch's threads, and those of the servers
# its tests start, would compete for them and run an order of magnitude slower. One thread each.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def _native_sources() -> list[tuple[str, Path]]:
    """(library name, source) of every native kernel installed: the core's ``csrc/<x>.cpp`` load as ``fw_<x>``, a
    plugin package's one ``csrc/*.cpp`` as the package's name."""
    import pkgutil

    import fw

    sources = [(f"fw_{path.stem}", path) for path in sorted((Path(fw.__file__).parent / "csrc").glob("*.cpp"))]
    for module in pkgutil.iter_modules():
        if module.name.startswith("fw_") and module.ispkg:
            package = Path(module.module_finder.path, module.name)
            sources += [(module.name, path) for path in sorted(package.glob("csrc/*.cpp"))]
    return sources


def pytest_sessionstart(session):
    """Build the native kernels two at a time before the first test: one build takes one core for 10-30 s, while
    the test that needed it first would wait. A build already made only loads; a failed one fails again, and
    logs why, in the test that needs it."""
    if os.environ.get("FW_NATIVE", "1") == "0" or XDIST_WORKER:  # under xdist the controller builds, before any worker
        return
    sources = _native_sources()
    code = "import sys, pathlib, fw.sdk.native as n; [n.load(a, pathlib.Path(b)) for a, b in zip(*[iter(sys.argv[1:])] * 2)]"
    workers = [
        subprocess.Popen([sys.executable, "-c", code, *(str(v) for pair in sources[i::2] for v in pair)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for i in range(2)
    ]
    for worker in workers:
        worker.wait()


def run_fw(*args: str, env: dict[str, str] | None = None, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    if pythonpath is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), full_env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "fw_cli", *args], capture_output=True, text=True, env=full_env, timeout=300
    )


def make_site(root: Path, dist: str, entry_points: dict[str, dict[str, str]], modules: dict[str, str]) -> Path:
    """A directory that looks like site-packages holding one installed distribution."""
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"{dist.replace('-', '_')}-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in eps.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    return root


@pytest.fixture
def fw_cli():
    return run_fw


@pytest.fixture
def fake_site(tmp_path):
    def build(dist: str, entry_points: dict[str, dict[str, str]], modules: dict[str, str]) -> Path:
        return make_site(tmp_path / "site", dist, entry_points, modules)

    return build


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def fw_serve(*args: str, env: dict[str, str] | None = None, command: str = "serve"):
    """A live `fw serve` (or another serving ``command``: `fw router`) on a free port: yields (base URL, process);
    ``process.log`` is its output so far."""
    port = free_port()
    # A file, not a pipe: the server logs every request and would block once a pipe nobody reads is full.
    with tempfile.NamedTemporaryFile("w+", prefix="fw-serve-", suffix=".log") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fw_cli", command, "--port", str(port), *args],
            stdout=log, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
        )
        proc.log = lambda: Path(log.name).read_text()
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 180
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"fw serve exited: {proc.log()}")
                try:
                    if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("fw serve did not start")
                time.sleep(0.3)
            yield base, proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()


@contextmanager
def together(*managers):
    """Enters the context managers ``managers`` (`fw_serve`s whose starts do not wait on each other) each on a
    thread of its own, so that their starts overlap, and exits them the same way; yields what they yield, in order.
    If one fails to enter, those that did are exited and its error is raised."""
    with ThreadPoolExecutor(len(managers)) as pool:
        entering = [pool.submit(m.__enter__) for m in managers]
    entered = [m for m, future in zip(managers, entering, strict=True) if future.exception() is None]
    try:
        yield [future.result() for future in entering]
    finally:
        with ThreadPoolExecutor(max(1, len(entered))) as pool:
            exits = [pool.submit(m.__exit__, None, None, None) for m in entered]
        for future in exits:
            future.result()


def wait_until(condition, timeout: float = 60, interval: float = 0.05):
    """Polls ``condition()`` until it is true and returns its value; fails the test if ``timeout`` seconds pass
    first. The timeout is a safety net for a broken behaviour, never what a test measures."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"still false after {timeout:g} s: {condition}"
        time.sleep(interval)
    return value


def metric_values(base: str) -> dict[str, float]:
    """A live server's /metrics: unlabelled samples, and counts summed over their labels."""
    text = httpx.get(f"{base}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels or sample.name.endswith("_count"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(arch, **kwargs) -> path; each distinct checkpoint is written once per module."""
    made = {}

    def make(arch, **kwargs):
        key = (arch, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in made:
            made[key] = make_tiny_model(arch, tmp_path_factory.mktemp(arch), **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random-weight Llama with a real tokenizer, built once per test module."""
    return str(make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("srv") / "llama"))


# --- quant plugin tests: the same prompts and greedy runs against every reference ---------------------------------

QUANT_PROMPTS = ["The quick brown fox", "Hello, world! How"]


def load_layers(path, quant, weights=None):
    """A checkpoint's model with ``quant``'s layers in float32 and no attention backend: its layers run alone."""
    from fw import model_registry
    from fw.model_loader import load_model
    from fw.models.base import HFConfig, ModelContext
    from fw.sdk.checkpoint import iter_safetensors

    config = model_registry.read_hf_config(str(path))
    ctx = ModelContext(dtype=torch.float32, quant=quant, attention=None)
    return load_model(model_registry.resolve(config).load(), HFConfig(config), ctx,
                      weights if weights is not None else iter_safetensors(path))


def fw_greedy(path, **kwargs) -> list[list[int]]:
    """16 greedy tokens of each of QUANT_PROMPTS from fw (float32 unless ``dtype`` says otherwise)."""
    from fw import LLM, SamplingParams

    llm = LLM(str(path), **{"dtype": "float32", "num_kv_blocks": 32, "max_model_len": 128, "device": "cpu", **kwargs})
    try:
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(QUANT_PROMPTS, params, use_tqdm=False)]
    finally:
        llm.shutdown()


def hf_greedy(model, tokenizer_path) -> list[list[int]]:
    """The same from a transformers model."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_path))
    out = []
    for prompt in QUANT_PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def assert_layers_match_modules(pairs, reference, decoded, tolerance: float) -> None:
    """Each fw linear layer against its checkpoint modules in ``reference`` (a transformers model) that it fuses:
    ``decoded(layer)``, its weight as the plugin decodes it, exactly equals theirs, and its outputs on random
    inputs are within ``tolerance`` (relative) of theirs. ``pairs``: (fw layer, its checkpoint module names)."""
    gen = torch.Generator().manual_seed(0)
    for layer, names in pairs:
        ref_modules = [reference.get_submodule(n) for n in names]
        assert torch.equal(decoded(layer), torch.cat([m.weight for m in ref_modules])), names
        x = 3 * torch.randn(1, 7, layer.spec.input_size, generator=gen)
        with torch.no_grad():
            expected = torch.cat([m(x) for m in ref_modules], dim=-1)[0]
            got = layer(x[0])
        error = ((got - expected).norm() / expected.norm()).item()
        assert error < tolerance, f"{names}: relative error {error:.3g}"


def assert_experts_match(model, reference, tolerance: float = 1e-5) -> list:
    """Every routed-expert block of ``model`` against the same block of ``reference`` on random tokens, its router
    left in float; returns the blocks."""
    from fw.layers.moe import FusedMoE

    blocks = [(n, m) for n, m in model.named_modules() if isinstance(getattr(m, "experts", None), FusedMoE)]
    assert blocks
    gen = torch.Generator().manual_seed(0)
    for name, block in blocks:
        assert block.gate.weight.dtype == torch.float32  # a rounded router would pick other experts
        x = torch.randn(16, block.experts.spec.hidden_size, generator=gen)
        with torch.no_grad():
            got, expected = block(x), reference.get_submodule(name)(x)
        error = ((got - expected).norm() / expected.norm()).item()
        assert error < tolerance, f"{name}: relative error {error:.3g}"
    return [block for _, block in blocks]
