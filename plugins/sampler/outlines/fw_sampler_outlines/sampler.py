"""Structured output: the default sampler, with tokens that would break the constraint masked out.

Lifecycle of a constrained request (one with ``SamplingParams.structured_outputs``;
requests without it cost nothing here):

* ``add_request`` turns the constraint into a regex and validates it on the
  caller's thread, raising ``ValueError("invalid JSON schema: ...")`` /
  ``("invalid regex: ...")`` / ``("constraint too large: ...")`` before
  admission (the size bounds are options: ``max_regex_length``, ``max_repeat``).
  It then compiles the regex against the tokenizer's vocabulary into an
  outlines-core ``Index`` in the background, in one of ``compile_workers``
  worker processes (fw.sdk.workers): some short regexes take minutes and gigabytes
  ((a|b)*a(a|b){20}), and only a process can be stopped, so a compilation past
  ``compile_timeout`` or ``compile_memory`` fails, and one whose requests were
  all removed (aborted) is killed. Compiled indexes are shared through an LRU
  keyed by (constraint, tokenizer), so repeated schemas compile once.
* ``is_ready`` is False while that compilation runs; the scheduler waits.
* A compilation that *fails* (a pattern inside a schema, or a regex feature,
  that outlines-core rejects after the up-front checks passed; a time or memory
  limit) makes the request ready anyway, and its first ``constrain`` raises
  ``RequestError`` naming it, so the engine fails that request alone. Failures
  stay in the LRU like successes (they are deterministic).
* If the output ever leaves the constraint (a token the mask did not allow was
  forced in), the request may only end: EOS is forced, and the reason is logged
  and kept: ``error(request_id)`` returns it until ``remove_request``.
* ``constrain`` (the default sampler's hook, after penalties/bias, before
  temperature and truncation) advances each request's automaton by the tokens
  appended since the previous step. It remembers the tokens it consumed, so an
  output that got shorter or changed (preemption, recompute) replays from the
  initial state. EOS is allowed only in accepting states; after EOS (with
  ``ignore_eos``) only EOS stays allowed.
* A constraint with ``reasoning_end`` (a reasoning model's "</think>") leaves the
  output free until a token completes that text; the guide starts at the next
  token. (A token that completes it and goes on past it puts its rest before the
  constrained text: reasoning models' end tags are tokens of their own.)
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

import outlines_core
import torch

from fw.interfaces.sampler import RequestError
from fw.sdk.sampler import DefaultSampler, plain_greedy
from fw.sdk.workers import WorkerError, WorkerPool
from fw_sampler_outlines.constraints import check_regex, check_size, choice_regex, json_object_regex, schema_regex
from fw_sampler_outlines.spec import OutlinesOptions
from fw_sampler_outlines.vocab import token_bytes

if TYPE_CHECKING:
    from pydantic import BaseModel

    from fw.interfaces.sampler import SamplingBatch
    from fw.sdk.sampling_params import SamplingParams, StructuredOutputsParams
    from fw.sdk.tokenizer import Tokenizer

log = logging.getLogger("fw.sampler.outlines")


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, W] int32 words (bit j of word w: token 32w + j, as outlines-core writes them) -> [B, vocab] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(bitmask.shape[0], -1)[:, :vocab]


@dataclass(frozen=True)
class _Compiled:
    index: outlines_core.Index
    words: int  # int32 words a mask needs to cover every token id of the vocabulary


@dataclass(eq=False)
class _Compilation:
    key: tuple[Any, ...]  # (constraint, tokenizer)
    future: Future[_Compiled]
    cancel: threading.Event  # set: kill the compilation's worker


@dataclass(eq=False)
class _Reasoning:
    """The free start of a reasoning model's output: the tokens up to the one that completes ``end``."""

    end: str
    tokenizer: Tokenizer
    tokens: list[int] = field(default_factory=list)  # the output tokens found free so far
    ended: bool = False

    def advance(self, output: list[int]) -> None:
        """Look for the end text in each token appended since the last call: a window of as many tokens as it has
        bytes holds every occurrence that a token completes (a token adds at least a byte)."""
        width = len(self.end.encode())
        while not self.ended and len(self.tokens) < len(output):
            self.tokens.append(output[len(self.tokens)])
            window = self.tokenizer.decode(self.tokens[-width:], skip_special_tokens=False)
            self.ended = self.end in window


@dataclass(eq=False)
class _Constraint:
    compilation: _Compilation  # shared by the requests with the same constraint
    eos_token_id: int
    reasoning: _Reasoning | None = None  # None: constrained from the first token
    guide: outlines_core.Guide | None = None
    words: int = 0
    consumed: list[int] = field(default_factory=list)  # constrained tokens the guide has advanced through
    ended: bool = False  # EOS consumed: nothing but EOS may follow
    error: str | None = None


class OutlinesSampler(DefaultSampler):
    def __init__(self, options: BaseModel | None = None) -> None:
        super().__init__(options if options is not None else OutlinesOptions())
        workers = self.options.compile_workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="fw-outlines-compile")
        self._workers = WorkerPool(workers, self.options.compile_memory, "fw-outlines-worker")
        self._compiled: OrderedDict[tuple[Any, ...], _Compilation] = OrderedDict()
        self._requests: dict[str, _Constraint] = {}
        # Built on the compile threads, once per tokenizer.
        self._vocabularies: WeakKeyDictionary[Tokenizer, tuple[outlines_core.Vocabulary, int]] = WeakKeyDictionary()
        self._vocabulary_lock = threading.Lock()

    # --- lifecycle ------------------------------------------------------------

    def add_request(self, request_id: str, params: SamplingParams, tokenizer: Tokenizer) -> None:
        constraint = params.structured_outputs
        if constraint is None:
            return
        if tokenizer.eos_token_id is None:
            raise ValueError("structured output needs a tokenizer with an EOS token")
        try:
            key = (constraint.key(), tokenizer)
        except RecursionError:  # json.dumps of a schema nested thousands deep
            raise ValueError("unsupported JSON schema: nested too deeply") from None
        compilation = self._compiled.get(key)
        if compilation is None:
            regex, cancel = self._regex(constraint), threading.Event()
            compilation = _Compilation(key, self._pool.submit(self._compile, regex, tokenizer, cancel), cancel)
            self._compiled[key] = compilation
            if len(self._compiled) > self.options.cache_size:
                self._compiled.popitem(last=False)  # requests still compiling it hold their own
        else:
            self._compiled.move_to_end(key)
        reasoning = _Reasoning(constraint.reasoning_end, tokenizer) if constraint.reasoning_end else None
        self._requests[request_id] = _Constraint(compilation, tokenizer.eos_token_id, reasoning)

    def argmax_suffices(self, request_ids: list[str], params: list[SamplingParams]) -> bool:
        return not any(r in self._requests for r in request_ids) and plain_greedy(params)

    def is_ready(self, request_id: str) -> bool:
        constraint = self._requests.get(request_id)
        return constraint is None or constraint.compilation.future.done()

    def remove_request(self, request_id: str) -> None:
        constraint = self._requests.pop(request_id, None)
        if constraint is None or constraint.compilation.future.done():
            return
        compilation = constraint.compilation
        if all(other.compilation is not compilation for other in self._requests.values()):
            # Nobody waits for it any more (its requests were aborted): stop it, and forget it.
            compilation.future.cancel()
            compilation.cancel.set()
            if self._compiled.get(compilation.key) is compilation:
                del self._compiled[compilation.key]

    def error(self, request_id: str) -> str | None:
        """Why a constrained request was ended with EOS instead of being constrained, or None."""
        constraint = self._requests.get(request_id)
        return constraint.error if constraint is not None else None

    # --- compiling --------------------------------------------------------------

    def _regex(self, constraint: StructuredOutputsParams) -> str:
        options = self.options
        if constraint.json is not None:
            regex = schema_regex(constraint.json, options.whitespace_pattern)
        elif constraint.json_object:
            regex = json_object_regex(options.whitespace_pattern)
        elif constraint.regex is not None:
            check_size(constraint.regex, options.max_regex_length, options.max_repeat)  # before parsing it again
            check_regex(constraint.regex)
            regex = constraint.regex
        else:
            regex = choice_regex(constraint.choice)
        check_size(regex, options.max_regex_length, options.max_repeat)
        return regex

    def _compile(self, regex: str, tokenizer: Tokenizer, cancel: threading.Event) -> _Compiled:
        vocabulary, words = self._vocabulary(tokenizer)
        options = self.options
        try:
            index = self._workers.call(outlines_core.Index, regex, vocabulary, timeout=options.compile_timeout,
                                       cancel=cancel)
        except TimeoutError:
            raise ValueError(f"it takes longer than {options.compile_timeout:g} s to compile (the outlines sampler's "
                             "compile_timeout)") from None
        except (MemoryError, WorkerError):
            raise ValueError(f"it needs more than {options.compile_memory.human_readable()} to compile (the outlines "
                             "sampler's compile_memory)") from None
        return _Compiled(index, words)

    def _vocabulary(self, tokenizer: Tokenizer) -> tuple[outlines_core.Vocabulary, int]:
        with self._vocabulary_lock:
            if tokenizer not in self._vocabularies:
                eos = tokenizer.eos_token_id
                by_bytes: dict[bytes, list[int]] = {}
                mapping = token_bytes(tokenizer.backend)
                for token_id, data in mapping.items():
                    if token_id != eos:  # outlines-core adds EOS itself, to accepting states only
                        by_bytes.setdefault(data, []).append(token_id)
                top = max([eos, *mapping])
                self._vocabularies[tokenizer] = (outlines_core.Vocabulary(eos, by_bytes), top // 32 + 1)
            return self._vocabularies[tokenizer]

    # --- masking ----------------------------------------------------------------

    def _advance(self, request_id: str, constraint: _Constraint, output: list[int]) -> None:
        """Bring the guide to the state after ``output`` (past the reasoning, if any), replaying from the start
        if the output changed."""
        if constraint.guide is None:
            try:
                compiled = constraint.compilation.future.result()  # blocks only if scheduled before is_ready
            except Exception as e:  # noqa: BLE001 - the request's own: constrain fails it
                raise ValueError(f"structured output: the constraint failed to compile: {e}") from None
            constraint.guide = outlines_core.Guide(compiled.index)
            constraint.words = compiled.words
        reasoning = constraint.reasoning
        free = reasoning.tokens if reasoning is not None else []
        done = len(constraint.consumed)
        if output[: len(free) + done] != free + constraint.consumed:
            constraint.guide.reset()
            constraint.consumed, constraint.ended, done = [], False, 0
            if reasoning is not None:
                reasoning.tokens, reasoning.ended = [], False
        if reasoning is not None and not reasoning.ended:
            reasoning.advance(output)
            if not reasoning.ended:
                return
            free = reasoning.tokens
        for token in output[len(free) + done :]:
            if token == constraint.eos_token_id:
                constraint.ended = True
            elif not constraint.ended:
                try:
                    constraint.guide.advance(token, return_tokens=False)
                except ValueError:
                    self._fail(request_id, constraint, f"token {token} at output position {done} breaks the constraint")
                    return
            constraint.consumed.append(token)
            done += 1

    def _fail(self, request_id: str, constraint: _Constraint, reason: str) -> None:
        constraint.error = reason
        log.warning("structured output of request %s ended: %s", request_id, reason)

    def constrain(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        rows: list[tuple[int, _Constraint]] = []
        failed: dict[str, Exception] = {}
        for row, (request_id, params) in enumerate(zip(batch.request_ids, batch.params, strict=True)):
            constraint = self._requests.get(request_id)
            if constraint is not None:
                if constraint.error is None:
                    try:
                        self._advance(request_id, constraint, batch.output_token_ids[row])
                    except ValueError as e:  # its constraint failed to compile
                        failed[request_id] = e
                if constraint.reasoning is None or constraint.reasoning.ended:  # a reasoning row is free
                    rows.append((row, constraint))
            elif params.structured_outputs is not None:
                raise RuntimeError(f"request {request_id} has structured_outputs but was never passed to add_request")
        if failed:
            raise RequestError(failed)
        if not rows:
            return logits
        vocab = logits.shape[-1]
        words = max([-(-vocab // 32), *(c.words for _, c in rows)])
        # All ones: unconstrained rows keep every token.
        bitmask = torch.full((len(batch.request_ids), words), -1, dtype=torch.int32)
        forced_eos = []
        for row, constraint in rows:
            if constraint.error is not None or constraint.ended:
                forced_eos.append((row, constraint.eos_token_id))
            else:
                bitmask[row].zero_()
                constraint.guide.write_mask_into(bitmask[row].data_ptr(), constraint.words, 4)
        allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), vocab)
        for row, eos in forced_eos:
            allowed[row] = False
            allowed[row, eos] = True
        masked = torch.where(allowed, logits, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
        # min_tokens bans EOS before this hook; where the constraint allows nothing else (it is complete), the
        # row would have no token left: let it end.
        row_ids = torch.tensor([row for row, _ in rows], device=logits.device)
        eos_ids = torch.tensor([c.eos_token_id for _, c in rows], device=logits.device)
        stuck = masked.isneginf().all(dim=-1)[row_ids]
        at_eos = masked[row_ids, eos_ids]
        masked[row_ids, eos_ids] = torch.where(stuck, torch.zeros_like(at_eos), at_eos)
        return masked
