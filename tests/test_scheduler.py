"""Scheduler policy details that the end-to-end engine tests don't pin down."""

from fw.config import FwConfig
from fw.kv_cache import KVCacheManager
from fw.request import Request
from fw.sampling_params import SamplingParams
from fw.scheduler import Scheduler


def make(policy: str = "fcfs", budget: int = 32, blocks: int = 16) -> Scheduler:
    config = FwConfig.model_validate(
        {"scheduler": {"scheduling_policy": policy, "max_num_batched_tokens": budget, "max_num_seqs": 8}}
    )
    return Scheduler(config, KVCacheManager(blocks, 4))


def req(rid: str, n: int, priority: int = 0) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4), priority=priority)


def test_priority_policy_admits_the_most_important_first():
    sched = make("priority", budget=10)
    for r in (req("late", 10, priority=5), req("urgent", 10, priority=0)):
        sched.add(r)
    batch = sched.schedule()
    assert [r.request_id for r in batch.requests] == ["urgent"]


def test_chunked_prefill_mixes_with_decodes_within_the_budget():
    sched = make(budget=8)
    first = req("a", 6)
    sched.add(first)
    batch = sched.schedule()
    inputs = sched.step_inputs(batch)
    sched.update(batch, inputs, [42], None)  # "a" sampled its first token
    sched.add(req("b", 20))
    batch = sched.schedule()
    # The decode of "a" (1 token) and a 7-token chunk of "b" share the step's 8-token budget.
    assert [(r.request_id, n) for r, n in zip(batch.requests, batch.num_new, strict=True)] == [("a", 1), ("b", 7)]
    assert sched.step_inputs(batch).sample_rows == [0]


def test_lowest_priority_running_request_is_preempted():
    sched = make("priority", budget=64, blocks=4)  # 16 token slots
    low, high = req("low", 7, priority=9), req("high", 7, priority=1)
    sched.add(low)
    sched.add(high)
    for _ in range(2):  # 7 + 2 tokens each: the second decode needs a fifth block
        batch = sched.schedule()
        sched.update(batch, sched.step_inputs(batch), [1, 1], None)
    batch = sched.schedule()
    assert batch.preempted == [low] and [r.request_id for r in batch.requests] == ["high"]
    assert low.num_computed_tokens == 0 and sched.waiting[0] is low
