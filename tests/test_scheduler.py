"""Scheduler policy details that the end-to-end engine tests don't pin down."""

from fw.config import FwConfig
from fw.kv_cache import KVCacheManager
from fw.request import Request
from fw.scheduler import Scheduler
from fw.sdk.sampling_params import SamplingParams


def make(policy: str = "fcfs", budget: int = 32, blocks: int = 16, **scheduler) -> Scheduler:
    config = FwConfig.model_validate({"scheduler": {
        "scheduling_policy": policy, "max_num_batched_tokens": budget, "max_num_seqs": 8, **scheduler}})
    return Scheduler(config, KVCacheManager(blocks, 4))


def req(rid: str, n: int, priority: int = 0) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4), priority=priority)


def test_priority_policy_admits_the_most_important_first():
    sched = make("priority", budget=10, long_prefill_token_threshold=0)
    for r in (req("late", 10, priority=5), req("urgent", 10, priority=0)):
        sched.add(r)
    batch = sched.schedule()
    assert [r.request_id for r in batch.requests] == ["urgent"]


def test_chunked_prefill_mixes_with_decodes_within_the_budget():
    sched = make(budget=8, long_prefill_token_threshold=0)
    first = req("a", 6)
    sched.add(first)
    batch = sched.schedule()
    inputs = sched.step_inputs(batch)
    sched.update(batch, inputs, [[42]], None)  # "a" sampled its first token
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
        sched.update(batch, sched.step_inputs(batch), [[1], [1]], None)
    batch = sched.schedule()
    assert batch.preempted == [low] and [r.request_id for r in batch.requests] == ["high"]
    assert low.num_computed_tokens == 0 and sched.waiting[0] is low


def _steps(sched: Scheduler) -> list[list[tuple[str, int]]]:
    """What each step computes until every prompt is in (the first token sampled is 1)."""
    steps = []
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in [*sched.waiting, *sched.running]):
        batch = sched.schedule()
        steps.append([(r.request_id, n) for r, n in zip(batch.requests, batch.num_new, strict=True)])
        inputs = sched.step_inputs(batch)
        sched.update(batch, inputs, [[1]] * len(inputs.sample_rows), None)
    return steps


def test_a_long_prompt_shares_the_step_with_the_requests_behind_it():
    # The default: a request computes at most a quarter of the budget a step, so the short prompts that arrived
    # behind a long one start in the first step instead of waiting for its whole prefill.
    sched = make(budget=16, blocks=32)
    for r in (req("long", 40), req("a", 4), req("b", 4), req("c", 4)):
        sched.add(r)
    steps = _steps(sched)
    assert steps[0] == [("long", 4), ("a", 4), ("b", 4), ("c", 4)]
    assert steps[1] == [("long", 4), ("a", 1), ("b", 1), ("c", 1)]  # the rest of the budget: their decodes
    assert all(n <= 4 for step in steps for _, n in step)


def test_long_prefill_token_threshold_as_set_and_zero_for_no_limit():
    sched = make(budget=16, blocks=32, long_prefill_token_threshold=6)
    for r in (req("long", 40), req("a", 4), req("b", 4)):
        sched.add(r)
    assert _steps(sched)[0] == [("long", 6), ("a", 4), ("b", 4)]
    sched = make(budget=16, blocks=32, long_prefill_token_threshold=0)  # vLLM's meaning of 0: no limit
    for r in (req("long", 40), req("a", 4)):
        sched.add(r)
    assert _steps(sched)[:3] == [[("long", 16)], [("long", 16)], [("long", 8), ("a", 4)]]


def test_without_chunked_prefill_prompts_are_never_split():
    sched = make(budget=16, blocks=32, enable_chunked_prefill=False)
    for r in (req("x", 12), req("a", 4), req("b", 4)):
        sched.add(r)
    assert _steps(sched)[:2] == [[("x", 12), ("a", 4)], [("x", 1), ("a", 1), ("b", 4)]]


def test_the_default_step_budget_depends_on_the_device():
    config = FwConfig.model_validate({})
    assert Scheduler(config, KVCacheManager(16, 4), device="cpu").token_budget == 512
    assert Scheduler(config, KVCacheManager(16, 4), device="cuda").token_budget == 2048
    config = FwConfig.model_validate({"scheduler": {"max_num_batched_tokens": 64}})
    assert Scheduler(config, KVCacheManager(16, 4), device="cpu").token_budget == 64
    assert Scheduler(config, KVCacheManager(16, 4), device="cpu").prefill_chunk == 16  # a quarter, by default
    config = FwConfig.model_validate({"scheduler": {"enable_chunked_prefill": False}})
    # Without chunked prefill a prompt runs in one step: the default budget holds the longest one.
    assert Scheduler(config, KVCacheManager(16, 4), device="cpu", max_model_len=4096).token_budget == 4096
