"""Runs model steps on one process, or on tensor-parallel worker processes.

With ``--tensor-parallel-size N`` the engine process is rank 0 and spawns
ranks 1..N-1. Each rank joins the world through the selected comm plugin and
builds its own ModelRunner from the configuration (plugins re-resolved by
name). Every step, rank 0 broadcasts the step's plain-data inputs over the
TP group; all ranks run the forward pass together.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import socket
from typing import Any

import torch

from fw import distributed, plugins
from fw.config import FwConfig, config_class
from fw.interfaces.comm import Communicator
from fw.model_runner import ModelRunner
from fw.scheduler import StepInputs
from fw.validate import CheckResult, check


def _broadcast_object(group: Communicator, obj: Any = None) -> Any:
    """Send a picklable object from group rank 0 to every rank, over the comm plugin's tensors."""
    if group.rank == 0:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        group.broadcast(torch.tensor([data.numel()], dtype=torch.int64), src=0)
        group.broadcast(data, src=0)
        return obj
    size = group.broadcast(torch.zeros(1, dtype=torch.int64), src=0)
    data = group.broadcast(torch.empty(int(size.item()), dtype=torch.uint8), src=0)
    return pickle.loads(data.numpy().tobytes())


def _join(config: FwConfig, rank: int, init_method: str, device: str) -> tuple[type[Communicator], Communicator]:
    spec, comm_cls = plugins.load_driver("comm", config.comm.name)
    layout = distributed.ParallelLayout(config.parallel.tensor_parallel_size)
    group = distributed.init_tensor_parallel(
        comm_cls, rank, layout, init_method, device, spec.parse_options(config.comm.options),
        config.parallel.distributed_timeout,
    )
    return comm_cls, group


def _worker(rank: int, config_data: dict, hf_config: dict, device: str, init_method: str) -> None:
    config = config_class().model_validate(config_data)
    comm_cls, group = _join(config, rank, init_method, device)
    runner = ModelRunner(config, check(config, hf_config=hf_config), hf_config, device)
    while (inputs := _broadcast_object(group)) is not None:
        runner.execute(inputs)
    comm_cls.destroy_world()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Executor:
    def __init__(self, config: FwConfig, result: CheckResult, hf_config: dict, device: str) -> None:
        self.world_size = config.parallel.tensor_parallel_size
        self.procs: list[mp.Process] = []
        self.group: Communicator | None = None
        if self.world_size > 1:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            ctx = mp.get_context("spawn")
            data = config.model_dump(mode="json")
            if config.server.api_key is not None:
                data["server"]["api_key"] = config.server.api_key.get_secret_value()
            for rank in range(1, self.world_size):
                proc = ctx.Process(target=_worker, args=(rank, data, hf_config, device, init_method), daemon=True)
                proc.start()
                self.procs.append(proc)
            self.comm_cls, self.group = _join(config, 0, init_method, device)
        self.runner = ModelRunner(config, result, hf_config, device)

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        if self.group is not None:
            _broadcast_object(self.group, inputs)
        return self.runner.execute(inputs)

    def shutdown(self) -> None:
        if self.group is not None:
            _broadcast_object(self.group, None)
            for proc in self.procs:
                proc.join(timeout=30)
            self.comm_cls.destroy_world()
            distributed.set_tp_group(distributed.SingleRank())
            self.group = None
