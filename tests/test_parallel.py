"""Parallel groups, the control plane and expert parallelism, on CPU gloo processes."""

from __future__ import annotations

import importlib.util
import multiprocessing
import socket

import pytest
import torch
from test_models import assert_tp2_matches_single_rank

from fw.distributed import ParallelLayout

pytest.importorskip("fw_comm_torch")

# NCCL's stand-in: on a GPU every tensor a model step hands the data plane is a CUDA tensor, and anything sent
# outside a step (the step's inputs, start-up agreements) would be a CPU tensor, which NCCL rejects.
CUDA_ONLY = '''
import torch
from fw.interfaces import comm
from fw.interfaces.spec import PluginSpec
from fw.sdk.torch_distributed import TorchDistributed


class CudaOnly(TorchDistributed):
    def _only_in_a_step(self, op, t):
        if not torch.is_inference_mode_enabled():
            raise RuntimeError(f"{op} of a CPU tensor {tuple(t.shape)} {t.dtype} outside a model step")

    def all_reduce(self, t):
        self._only_in_a_step("all_reduce", t)
        return super().all_reduce(t)

    def all_gather(self, t, dim=-1):
        self._only_in_a_step("all_gather", t)
        return super().all_gather(t, dim)

    def reduce_scatter(self, t, dim=0):
        self._only_in_a_step("reduce_scatter", t)
        return super().reduce_scatter(t, dim)

    def all_to_all(self, t, send_counts, recv_counts):
        self._only_in_a_step("all_to_all", t)
        return super().all_to_all(t, send_counts, recv_counts)

    def broadcast(self, t, src=0):
        self._only_in_a_step("broadcast", t)
        return super().broadcast(t, src)

    def send(self, t, dst):
        self._only_in_a_step("send", t)
        super().send(t, dst)

    def recv(self, t, src):
        self._only_in_a_step("recv", t)
        return super().recv(t, src)


SPEC = PluginSpec(
    name="cuda-only", kind="comm", impl="cuda_only:CudaOnly", capabilities=comm.CommCapabilities(),
    api_version=comm.API_VERSION, description="torch.distributed refusing CPU tensors outside a model step",
)
'''


GREEDY_PROMPTS = [[5, 9, 14, 200, 31], [7, 7, 301, 2, 45, 46, 47, 11, 90]]
# Four requests of different lengths, stepping together: PP=2 runs each step as two micro-batches of two.
FOUR_PROMPTS = [*GREEDY_PROMPTS, [12, 250, 3], [88, 1, 64, 9, 17, 230, 4]]


def greedy(path, prompts=GREEDY_PROMPTS, **kwargs) -> list[list[int]]:
    """24 greedy tokens of each of ``prompts``, in float32 on the CPU."""
    from fw import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", num_kv_blocks=32, device="cpu", **kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_layout_groups():
    layout = ParallelLayout(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2, expert_parallel=True)
    assert layout.partition("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.partition("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.partition("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.partition("ep") == [[0, 1, 4, 5], [2, 3, 6, 7]]  # DP x TP within a pipeline stage
    assert ParallelLayout(tensor_parallel_size=2).partition("ep") == [[0], [1]]  # off: experts are TP-sharded


@pytest.mark.slow
def test_expert_parallel_2_matches_single_rank(checkpoint, tmp_path):
    """EP=2: each rank holds half of the experts whole; tokens reach them through the torch plugin's
    dispatch/combine; 24 greedy tokens and their logits equal the single-rank run's. Qwen2-MoE's shared expert
    and DeepSeek-V3's shared experts (behind its own router) stay replicated."""
    archs = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "DeepseekV3ForCausalLM")
    paths = [checkpoint(arch) for arch in archs]
    assert_tp2_matches_single_rank(paths, tmp_path, expert_parallel=True, decode_steps=24)


@pytest.mark.slow
def test_step_inputs_never_touch_the_data_plane(checkpoint, fake_site, monkeypatch, request, tmp_path):
    """TP=2 with expert parallelism through the engine, on a comm plugin that refuses tensors outside a model
    step: the step inputs and the KV-cache agreement travel on the control plane. The checkpoint is FP8 (the fp8
    plugin's MoEMethod holds the experts); the output equals one process's."""
    from fw import plugins
    from fw_quant_fp8.testing import write_checkpoint

    site = fake_site("fw-comm-cuda-only", {"fw.comm": {"cuda-only": "cuda_only:SPEC"}}, {"cuda_only": CUDA_ONLY})
    monkeypatch.syspath_prepend(str(site))  # the spawned workers inherit sys.path
    plugins.refresh()
    request.addfinalizer(plugins.refresh)
    path = write_checkpoint(checkpoint("Qwen3MoeForCausalLM"), tmp_path / "fp8", activations=None)
    assert greedy(path, tensor_parallel_size=2, enable_expert_parallel=True, comm="cuda-only") == greedy(path)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "tp"), [("LlamaForCausalLM", 1), ("Qwen2ForCausalLM", 1), ("Qwen2ForCausalLM", 2)])
def test_pipeline_parallel_matches_single_process(checkpoint, arch, tp):
    """PP=2 (and TP=2 x PP=2, four processes) with four requests at once: each stage holds half of the layers and
    runs each step as two micro-batches; hidden states and the residual stream pass by send/recv; the last stage's
    logits reach rank 0. Greedy tokens equal one process's."""
    path = checkpoint(arch)
    assert greedy(path, FOUR_PROMPTS, pipeline_parallel_size=2, tensor_parallel_size=tp) == greedy(path, FOUR_PROMPTS)


@pytest.mark.slow
def test_uneven_pipeline_split_matches_single_process(checkpoint, monkeypatch):
    """FW_PP_LAYER_PARTITION=1,3 (vLLM's VLLM_PP_LAYER_PARTITION) on a four-layer model: the same greedy tokens."""
    path = checkpoint("LlamaForCausalLM", num_hidden_layers=4)
    expected = greedy(path, FOUR_PROMPTS)
    monkeypatch.setenv("FW_PP_LAYER_PARTITION", "1,3")
    assert greedy(path, FOUR_PROMPTS, pipeline_parallel_size=2) == expected


# Two steps of four requests: their prompts, then one token each. (token_ids, num_computed, num_new) per step.
MICRO_BATCH_STEPS = [
    (sum(FOUR_PROMPTS, []), [0, 0, 0, 0], [len(p) for p in FOUR_PROMPTS]),
    ([3, 4, 5, 6], [len(p) for p in FOUR_PROMPTS], [1, 1, 1, 1]),
]
SLOW_STAGE_S = 0.5  # how long the last stage lingers over its first micro-batch


def _step_inputs(token_ids, num_computed, num_new):
    from itertools import accumulate

    from fw.step_inputs import StepInputs

    ends = list(accumulate(num_new))
    return StepInputs(
        token_ids=token_ids,
        num_computed=num_computed,
        num_new=num_new,
        block_tables=[[2 * i, 2 * i + 1] for i in range(4)],
        sample_rows=[0, 1, 2, 3],
        logit_positions=[end - 1 for end in ends],
        copies=[],
    )


def _config(path, parallel):
    from fw.config import FwConfig

    return FwConfig(
        model={"model": path, "dtype": "float32", "device": "cpu"}, cache={"num_kv_blocks": 16}, parallel=parallel
    )


def _runner(config):
    from fw.model_registry import read_hf_config
    from fw.model_runner import ModelRunner
    from fw.validate import check

    hf_config = read_hf_config(config.model.model)
    result = check(config, hf_config=hf_config)
    assert not result.problems, result.problems
    return ModelRunner(config, result, hf_config, "cpu")


def _pipeline_worker(rank: int, init_method: str, path: str, parallel: dict, queue) -> None:
    """A pipeline stage running MICRO_BATCH_STEPS; reports its layers, when each model call (one per micro-batch)
    started and ended, and its logits."""
    import time

    from fw import distributed
    from fw.executor import _join

    torch.set_num_threads(1)
    config = _config(path, parallel)
    comm_cls = _join(config, rank, init_method, "cpu")
    try:
        runner = _runner(config)
        starts, ends = [], []

        def ended(*_):
            if rank == 1 and not ends:  # the next stage is slow: the first must not wait for it
                time.sleep(SLOW_STAGE_S)
            ends.append(time.monotonic())

        runner.model.register_forward_pre_hook(lambda *_: starts.append(time.monotonic()))
        runner.model.register_forward_hook(ended)
        logits = [runner.execute(_step_inputs(*step)) for step in MICRO_BATCH_STEPS]
        # By value: a queued tensor shares its storage through a socket that dies with this process, so the
        # parent's get can fail once the worker has exited.
        logits = [None if x is None else x.numpy() for x in logits]
        queue.put((rank, list(runner.model.stage), starts, ends, logits))
    finally:
        distributed.destroy_parallel(comm_cls)


@pytest.mark.slow
@pytest.mark.parametrize(("partition", "stages"), [(None, [[0, 1], [2, 3]]), ([1, 3], [[0], [1, 2, 3]])])
def test_pipeline_stages_overlap_on_micro_batches(checkpoint, partition, stages):
    """PP=2, four requests a step: each stage runs two micro-batches a step. Stage 0 starts its second while
    stage 1 still works on the first, and has sent the second on before stage 1 takes it (its sends do not
    wait). The stages hold the layers of ``parallel.pp_layer_partition`` (else an even split); rank 0's logits
    equal one process's."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    path = str(checkpoint("LlamaForCausalLM", num_hidden_layers=4))
    parallel = {"pipeline_parallel_size": 2, "pp_layer_partition": partition}
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_pipeline_worker, args=(rank, init_method, path, parallel, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    reports = {rank: rest for rank, *rest in (queue.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    (layers0, starts0, ends0, logits), (layers1, starts1, ends1, _) = reports[0], reports[1]
    assert [layers0, layers1] == stages
    assert len(starts0) == len(starts1) == 2 * len(MICRO_BATCH_STEPS)  # two micro-batches a step
    assert starts0[1] < ends1[0]  # stage 0 on micro-batch 2 while stage 1 is on micro-batch 1
    assert ends0[1] < starts1[1]  # ... and done with it, sent on, before stage 1 asks for it
    single = _runner(_config(path, {}))
    with torch.inference_mode():
        expected = [single.execute(_step_inputs(*step)) for step in MICRO_BATCH_STEPS]
    for got, want in zip(logits, expected, strict=True):
        torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-5, atol=1e-5)


def _kv_worker(rank: int, init_method: str, path: str, queue) -> None:
    from fw import distributed
    from fw.config import FwConfig
    from fw.model_registry import read_hf_config
    from fw.model_runner import ModelRunner
    from fw.sdk.torch_distributed import TorchDistributed
    from fw.validate import check

    torch.set_num_threads(1)
    distributed.init_parallel(TorchDistributed, rank, ParallelLayout(tensor_parallel_size=2), init_method, "cpu")
    try:
        # Rank 1 has less memory for its cache, as a fuller GPU would.
        config = FwConfig(model={"model": path, "dtype": "float32", "device": "cpu"},
                          cache={"kv_cache_memory": (4 - rank) << 20}, parallel={"tensor_parallel_size": 2})
        hf_config = read_hf_config(path)
        runner = ModelRunner(config, check(config, hf_config=hf_config), hf_config, "cpu")
        queue.put((rank, runner.num_blocks, runner.kv_caches[0].shape, runner.bytes_per_block))
    finally:
        distributed.destroy_parallel(TorchDistributed)


@pytest.mark.slow
def test_kv_block_count_is_the_same_on_every_rank(checkpoint):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    path = str(checkpoint("LlamaForCausalLM"))
    procs = [ctx.Process(target=_kv_worker, args=(rank, init_method, path, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    reports = dict((rank, rest) for rank, *rest in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    (blocks0, shape0, per_block), (blocks1, shape1, _) = reports[0], reports[1]
    assert blocks0 == blocks1 == (3 << 20) // per_block  # rank 1's smaller budget decides
    assert shape0 == shape1


@pytest.mark.parametrize(
    ("parallel", "hf_config", "problem"),
    [
        ({}, {"num_local_experts": 4}, "needs more than one rank"),
        ({"tensor_parallel_size": 2}, {}, "the model has no routed experts"),
        ({"tensor_parallel_size": 2}, {"n_routed_experts": 3}, "3 experts do not split evenly over 2 ranks"),
        ({"tensor_parallel_size": 2}, {"num_experts": 8}, None),
    ],
)
def test_expert_parallel_is_refused_where_it_cannot_shard(parallel, hf_config, problem):
    from fw.config import FwConfig
    from fw.validate import check

    config = FwConfig(model={"device": "cpu"}, parallel={**parallel, "enable_expert_parallel": True})
    found = [p for p in check(config, hf_config={"hidden_size": 64, **hf_config}).problems if "expert-parallel" in p]
    assert [problem in p for p in found] == ([] if problem is None else [True]), found


@pytest.mark.parametrize(
    ("hf_config", "problem"),
    [
        ({"num_hidden_layers": 1}, "--pipeline-parallel-size 2: more stages than the model's 1 layers"),
        ({"num_hidden_layers": 2}, None),
    ],
)
def test_pipeline_parallel_is_refused_with_more_stages_than_layers(hf_config, problem):
    from fw.config import FwConfig
    from fw.validate import check

    config = FwConfig(model={"device": "cpu"}, parallel={"pipeline_parallel_size": 2})
    found = [p for p in check(config, hf_config={"hidden_size": 64, **hf_config}).problems if "pipeline" in p]
    assert found == ([] if problem is None else [problem])


PARTITION_FORM = "give one positive layer count per pipeline stage, comma-separated, summing to the model's 4 layers"


@pytest.mark.parametrize(
    ("stages", "partition", "problem"),
    [
        (2, [1, 3], None),
        (2, [4], "4: 1 counts for --pipeline-parallel-size 2"),
        (1, [2, 2], "2,2: 2 counts for --pipeline-parallel-size 1"),
        (2, [0, 4], "0,4: a stage without layers"),
        (2, [1, 2], "1,2: they sum to 3, not 4"),
        (3, [2, 3], "2,3: 2 counts for --pipeline-parallel-size 3; they sum to 5, not 4"),
    ],
)
def test_pipeline_layer_partition_is_refused_unless_it_splits_the_model(stages, partition, problem):
    from fw.config import FwConfig
    from fw.validate import check

    parallel = {"pipeline_parallel_size": stages, "pp_layer_partition": partition}
    config = FwConfig(model={"device": "cpu"}, parallel=parallel)
    problems = check(config, hf_config={"hidden_size": 64, "num_hidden_layers": 4}).problems
    found = [p for p in problems if "pipeline" in p]
    prefix = "parallel.pp_layer_partition (--pp-layer-partition, FW_PP_LAYER_PARTITION) "
    assert found == ([] if problem is None else [f"{prefix}{problem}; {PARTITION_FORM}"])


def test_pipeline_layer_partition_comes_from_the_environment_as_vllm_spells_it(monkeypatch):
    from fw.config import ConfigError, cli_options, load_config

    assert "--pp-layer-partition" in {o.flag for o in cli_options()}
    monkeypatch.setenv("FW_PP_LAYER_PARTITION", "1, 3")
    resolved = load_config()
    assert resolved.config.parallel.pp_layer_partition == [1, 3]
    assert resolved.source("parallel.pp_layer_partition") == "env FW_PP_LAYER_PARTITION"
    flag = load_config(cli={"parallel": {"pp_layer_partition": "2,2"}})
    assert flag.config.parallel.pp_layer_partition == [2, 2]  # the command line wins
    monkeypatch.setenv("FW_PARALLEL__PP_LAYER_PARTITION", "[3, 1]")
    assert load_config().config.parallel.pp_layer_partition == [3, 1]  # the FW_SECTION__FIELD name wins
    monkeypatch.setenv("FW_PP_LAYER_PARTITION", "1,three")
    monkeypatch.delenv("FW_PARALLEL__PP_LAYER_PARTITION")
    with pytest.raises(ConfigError, match=r"parallel.pp_layer_partition.*from env FW_PP_LAYER_PARTITION"):
        load_config()


def test_pipeline_parallel_is_refused_for_a_model_without_the_feature(monkeypatch):
    from dataclasses import replace

    from fw import model_registry
    from fw.config import FwConfig
    from fw.models import specs
    from fw.validate import check

    plain = replace(specs.LLAMA, capabilities=replace(specs.LLAMA.capabilities, features=frozenset()))
    monkeypatch.setattr(model_registry, "resolve", lambda hf_config: plain)
    config = FwConfig(model={"device": "cpu"}, parallel={"pipeline_parallel_size": 2})
    hf_config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4}
    assert "--pipeline-parallel-size 2: model plugin 'llama' does not declare pipeline_parallel" in (
        check(config, hf_config=hf_config).problems
    )


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-node Ray cluster on 127.0.0.1, as `ray start --head` makes one; stopped by SIGTERM to its process
    (never `ray stop`, which kills every Ray process on the machine by name)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    # Keeps the node's address, and the address this process joins at, on loopback rather than the machine's first
    # interface. Ray reads it when imported: before the import.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    pytest.importorskip("ray", reason="ray is not installed (pip install ray)")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    head = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
         "--port", str(port), "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while subprocess.run([str(Path(sys.executable).parent / "ray"), "status", "--address", address], env=env,
                         capture_output=True).returncode:
        assert head.poll() is None and time.monotonic() < deadline, "the Ray head did not start"
        time.sleep(1)
    yield address
    import ray

    ray.shutdown()
    head.send_signal(signal.SIGTERM)
    head.wait(timeout=90)
    del os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"]


@pytest.mark.slow
def test_ray_executor_matches_one_process(checkpoint, ray_cluster, monkeypatch):
    """TP=2 with rank 1 a Ray actor on the cluster RAY_ADDRESS names: the same greedy tokens as one process."""
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    path = checkpoint("Qwen2ForCausalLM")
    assert greedy(path, tensor_parallel_size=2, distributed_executor_backend="ray") == greedy(path)


def test_ray_executor_is_refused_where_it_cannot_run(monkeypatch):
    from fw.config import FwConfig
    from fw.interfaces.base import Requirements
    from fw.validate import _ray_problems

    config = FwConfig(parallel={"distributed_executor_backend": "ray"})
    assert _ray_problems(config, Requirements(device="cpu")) == (
        [] if importlib.util.find_spec("ray") else ["--distributed-executor-backend ray needs the ray package (pip install ray)"]
    )
    assert "--distributed-executor-backend ray on CUDA is not implemented yet (use mp on one machine)" in _ray_problems(
        config, Requirements(device="cuda")
    )
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert "--distributed-executor-backend ray needs the ray package (pip install ray)" in _ray_problems(
        config, Requirements(device="cpu")
    )
