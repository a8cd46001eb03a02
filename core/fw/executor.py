"""Runs model steps on one process, or on tensor- and pipeline-parallel worker processes.

With ``-tp T -pp P`` the engine process is rank 0 and starts ranks
1..T*P-1: as processes on this machine (``--distributed-executor-backend
mp``), or as Ray actors on the running Ray cluster (``ray``), each asking Ray
for one CPU, so that the ranks span the cluster's machines. Each rank joins the
world through the selected comm plugin and builds its own ModelRunner from the
configuration (plugins re-resolved by name). Every step, rank 0 broadcasts the
step's plain-data inputs on the control plane (CPU gloo, never the comm
plugin's data plane, which may be NCCL); all ranks run the forward pass
together.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import torch

from fw import distributed, plugins
from fw.config import FwConfig, config_class, picklable
from fw.interfaces.comm import Communicator
from fw.model_runner import ModelRunner
from fw.step_inputs import StepInputs
from fw.validate import CheckResult, check


def layout(config: FwConfig) -> distributed.ParallelLayout:
    parallel = config.parallel
    return distributed.ParallelLayout(
        parallel.tensor_parallel_size, parallel.pipeline_parallel_size, expert_parallel=parallel.enable_expert_parallel
    )


def _join(config: FwConfig, rank: int, init_method: str, device: str) -> type[Communicator]:
    comm_cls, options = plugins.load_driver("comm", config.comm.name, config.comm.options)
    distributed.init_parallel(
        comm_cls, rank, layout(config), init_method, device, options,
        config.parallel.distributed_timeout, config.parallel.pp_layer_partition,
    )
    return comm_cls


def _worker(rank: int, config_data: dict, hf_config: dict, device: str, init_method: str) -> None:
    config = config_class().model_validate(config_data)
    comm_cls = _join(config, rank, init_method, device)
    runner = ModelRunner(config, check(config, hf_config=hf_config), hf_config, device)
    control = distributed.get_control_plane()
    while (inputs := control.broadcast()) is not None:
        runner.execute(inputs)
    distributed.destroy_parallel(comm_cls)


def _start_mp(world_size: int, args: tuple, init_method: str) -> list[mp.Process]:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(rank, *args, init_method), daemon=True) for rank in range(1, world_size)]
    for proc in procs:
        proc.start()
    return procs


class _RayWorker:
    """A rank as a Ray actor: ``run`` is the worker loop, returning when rank 0 broadcasts the end."""

    def run(self, rank: int, config_data: dict, hf_config: dict, device: str, init_method: str) -> None:
        _worker(rank, config_data, hf_config, device, init_method)


def _start_ray(world_size: int, args: tuple) -> tuple[str, list, list]:
    """Ranks 1..N-1 as actors on the running cluster; returns rank 0's address (this node's, as Ray sees it), the
    actors and their runs."""
    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), ignore_reinit_error=True, log_to_driver=False)
    init_method = f"tcp://{ray.util.get_node_ip_address()}:{distributed.free_port('')}"
    actor = ray.remote(num_cpus=1)(_RayWorker)
    actors = [actor.remote() for _ in range(1, world_size)]
    return init_method, actors, [a.run.remote(rank, *args, init_method) for rank, a in enumerate(actors, start=1)]


class Executor:
    def __init__(self, config: FwConfig, result: CheckResult, hf_config: dict, device: str) -> None:
        self.world_size = layout(config).world_size
        self.procs: list[mp.Process] = []
        self.ray_actors: list = []  # with --distributed-executor-backend ray, and their run() results
        self.ray_runs: list = []
        self.comm_cls: type[Communicator] | None = None
        if self.world_size > 1:
            args = (picklable(config), hf_config, device)
            if config.parallel.distributed_executor_backend == "ray":
                init_method, self.ray_actors, self.ray_runs = _start_ray(self.world_size, args)
            else:
                init_method = f"tcp://127.0.0.1:{distributed.free_port()}"
                self.procs = _start_mp(self.world_size, args, init_method)
            self.comm_cls = _join(config, 0, init_method, device)
        self.runner = ModelRunner(config, result, hf_config, device)

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        if self.comm_cls is not None:
            distributed.get_control_plane().broadcast(inputs)
        return self.runner.execute(inputs)

    def shutdown(self) -> None:
        if self.comm_cls is not None:
            distributed.get_control_plane().broadcast(None)
            for proc in self.procs:
                proc.join(timeout=30)
            if self.ray_actors:
                import ray

                ray.wait(self.ray_runs, num_returns=len(self.ray_runs), timeout=30)
                for actor in self.ray_actors:
                    ray.kill(actor)
            distributed.destroy_parallel(self.comm_cls)
            self.comm_cls = None
