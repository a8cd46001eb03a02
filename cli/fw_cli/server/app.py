"""The OpenAI-compatible HTTP server behind `fw serve`, with vLLM's extensions."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import reprlib
import secrets
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fw import __version__
from fw.config import ServerSection
from fw.engine.client import EngineClient, EngineError
from fw.inputs import TokensPrompt
from fw.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from fw.sdk.chat import ChatTemplateError, load_template, render_chat
from fw.sdk.sampling_params import SamplingParams, SamplingParamsError
from fw.sdk.workers import WorkerError, WorkerPool
from fw.tool_calls import (
    ChatDelta,
    ChatParsers,
    OutputReader,
    ToolCallError,
    ToolRequest,
    chat_params,
    finish_reason,
    tool_request,
)
from fw_cli.server.embeddings import embedding_response, pooling_params
from fw_cli.server.metrics import Metrics
from fw_cli.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    StreamOptions,
    TokenizeRequest,
)

log = logging.getLogger("fw.server")
_NEUTRAL = SamplingParams()
MIN_LOGPROB = -9999.0  # JSON has no -inf: OpenAI and vLLM send this instead
# What the engine runs: (prompt, params, engine request id, priority), as EngineClient.generate_many takes them.
Submission = tuple[TokensPrompt, SamplingParams, str, int]
T = TypeVar("T")
DOCS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
RETRY_AFTER = {"Retry-After": "1"}  # seconds a turned-away client is asked to wait
DISCONNECT_POLL_S = 0.2  # how often a request whose response has not started looks for its client having gone
# A text longer than this per context token cannot fit: a prompt is refused before it is tokenized (unless it
# asks for truncation), a chat template's rendering is stopped.
CHARS_PER_TOKEN = 64
# Chat templates render in worker processes (a request's template may loop for ever or eat memory), bounded in
# time and memory.
RENDER_TIMEOUT_S = 2.0
RENDER_MEMORY = 1024**3
# The rendering's own inputs and HF apply_chat_template's parameters: never a request's template variable
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "conversation", "tokenizer", "chat_template", "tools",
                                         "documents", "tokenize"})


def _validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0]
    loc = [str(p) for p in first["loc"] if p != "body"]
    if first["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first['msg']}")
    return APIError(400, f"{'.'.join(loc) or 'body'}: {first['msg']}", param=".".join(loc) or None)


REQUEST_ERRORS = (EngineError, SamplingParamsError, ToolCallError)  # the request's own fault: a 400 naming the field


@contextlib.contextmanager
def _as_400() -> Iterator[None]:
    try:
        yield
    except REQUEST_ERRORS as exc:
        raise _api_error(exc) from None


def _api_error(exc: Exception, request_id: str = "") -> APIError:
    """What a client is told of an exception: its request's error, or an internal one (logged, with the id)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, REQUEST_ERRORS):
        return APIError(400, str(exc), param=getattr(exc, "field", None))
    log.error("request %s failed", request_id, exc_info=exc)
    return APIError(500, f"internal server error (request id {request_id}); the server log has the details",
                    "InternalServerError")


def _summary(params: SamplingParams) -> str:
    """The settings that differ from SamplingParams(), each shortened, for the per-request log line."""
    return ", ".join(
        f"{f.name}={reprlib.repr(getattr(params, f.name))}"
        for f in dataclasses.fields(params)
        if getattr(params, f.name) != getattr(_NEUTRAL, f.name)
    )


class Server:
    def __init__(self, engine: EngineClient, served_model_name: str, settings: ServerSection,
                 defaults: dict[str, Any] | None = None):
        self.engine = engine
        self.tokenizer = engine.view.tokenizer
        self.vocab_size = engine.view.vocab_size
        self.max_model_len = engine.view.max_model_len
        self.model_name = served_model_name
        self.settings = settings
        self.api_key = settings.api_key.get_secret_value() if settings.api_key else None
        # What needs no API key.
        self.public = {"/health", *(["/metrics"] if settings.public_metrics else []),
                       *(DOCS if settings.public_docs else [])}
        self.chat_template = load_template(settings.chat_template)
        self.parsers = ChatParsers.from_config(engine.view.config.chat)
        self.renderer = WorkerPool(min(4, os.cpu_count() or 1), RENDER_MEMORY, "fw-chat-template")
        self.max_logprobs = settings.max_logprobs
        self.log_requests = not settings.disable_log_requests
        self.defaults = defaults or {}  # SamplingParams values for fields a request leaves unset
        self.metrics = Metrics(engine)
        self.created = int(time.time())
        self.num_waiting = 0  # generation requests received and not generating yet
        self.draining = False  # shutting down: in-flight requests finish, new ones are turned away

    def authenticate(self, request: Request) -> Response | None:
        """None when the request may pass; else the 401 (the bearer scheme in any case, the key compared in
        constant time)."""
        if not self.api_key or request.url.path in self.public:
            return None
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(key.strip().encode(), self.api_key.encode()):
            return None
        err = APIError(401, "Incorrect API key provided.", "AuthenticationError", code="invalid_api_key")
        return JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})

    @contextlib.contextmanager
    def _queued(self) -> Iterator[Callable[[], None]]:
        """Count a generation request as waiting until it generates (it calls what it gets) or ends; beyond
        --max-num-waiting of them the server answers 429, while shutting down 503, each with Retry-After."""
        if self.draining:
            raise APIError(503, "the server is shutting down", "ServiceUnavailableError", headers=RETRY_AFTER)
        if self.num_waiting >= self.settings.max_num_waiting:
            raise APIError(429, f"{self.num_waiting} requests are waiting already (--max-num-waiting); retry later",
                           "RateLimitError", headers=RETRY_AFTER)
        self.num_waiting += 1
        waiting = True

        def started() -> None:
            nonlocal waiting
            if waiting:
                waiting = False
                self.num_waiting -= 1

        try:
            yield started
        finally:
            started()

    @staticmethod
    async def _unless_disconnected(http: Request, work: Awaitable[T]) -> T:
        """``work``, cancelled (its engine requests aborted) once the client disconnects: nothing else would stop a
        request whose response has not started."""
        task = asyncio.ensure_future(work)
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await http.is_disconnected():
                    raise APIError(499, "the client disconnected", "ClientClosedRequest")
            return task.result()
        finally:
            task.cancel()

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "NotFoundError", "model", "model_not_found")

    @staticmethod
    def _request_id(body, http: Request) -> str:
        """The X-Request-Id header, else the body's request_id (vLLM's order), else a fresh one."""
        return http.headers.get("x-request-id") or body.request_id or uuid.uuid4().hex

    def _prompt(self, prompt: str | list[int], body) -> TokensPrompt:
        """Token ids as the request asks (special tokens, truncation to the last k), with the text to echo."""
        if isinstance(prompt, str):
            if body.truncate_prompt_tokens is None:
                self._check_length(prompt)
            ids = self.tokenizer.encode(prompt, add_special_tokens=body.add_special_tokens)
        elif all(0 <= t < self.vocab_size for t in prompt):
            ids = list(prompt)
        else:
            raise APIError(400, f"prompt: token ids must be in [0, {self.vocab_size})", param="prompt")
        keep = self.max_model_len if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:]
        elif isinstance(prompt, str):
            return TokensPrompt(prompt_token_ids=ids, prompt=prompt)
        # Token ids, or a truncated text: the text echoed is what the ids decode to.
        return TokensPrompt(prompt_token_ids=ids, prompt=self.tokenizer.decode(ids, skip_special_tokens=False))

    async def _tokenized(self, body, prompts: list[str | list[int]], param: str) -> list[TokensPrompt]:
        """A request's prompts (at most --max-prompts-per-request) as token ids, tokenized off the event loop."""
        limit = self.settings.max_prompts_per_request
        if len(prompts) > limit:
            raise APIError(400, f"{param}: at most {limit} prompts in one request (--max-prompts-per-request)",
                           param=param)
        return await asyncio.to_thread(lambda: [self._prompt(p, body) for p in prompts])

    def _check_length(self, text: str) -> None:
        """Refuse a prompt too long for the context by its length alone, before tokenizing it costs seconds."""
        if len(text) > CHARS_PER_TOKEN * self.max_model_len:
            raise APIError(400, f"prompt: {len(text)} characters cannot fit max_model_len {self.max_model_len}",
                           param="prompt")

    async def _chat_prompt(self, body: ChatCompletionRequest | TokenizeRequest,
                           tools: ToolRequest | None = None) -> TokensPrompt:
        """The messages (and ``tools``) rendered by the server's template (or, where allowed, the request's) in a
        worker process, then tokenized off the event loop. A template that ignores the tools of a request that
        may call them is refused: the model would never see them."""
        param = "messages" if body.chat_template is None else "chat_template"
        if body.chat_template is not None and not self.settings.allow_request_chat_template:
            raise APIError(400, "chat_template: this server renders chats with its own template; start it with "
                           "--allow-request-chat-template to take a request's", param=param)
        template = body.chat_template or self.chat_template or self.tokenizer.chat_template
        if not template:
            raise APIError(400, "the model has no chat template; start the server with --chat-template", param=param)
        kwargs = dict(body.chat_template_kwargs or {})  # they may set the two flags, as in vLLM
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES & kwargs.keys())
        if reserved:
            raise APIError(400, f"chat_template_kwargs: {', '.join(reserved)} cannot be set by a request (reserved: "
                           f"{', '.join(sorted(RESERVED_TEMPLATE_VARIABLES))})", param="chat_template_kwargs")
        continue_final = bool(kwargs.pop("continue_final_message", body.continue_final_message))
        add_generation = kwargs.pop("add_generation_prompt", not continue_final if body.add_generation_prompt is None
                                    else body.add_generation_prompt)
        variables = {"bos_token": self.tokenizer.bos_token or "", "eos_token": self.tokenizer.eos_token or "", **kwargs}
        messages = [m.for_template() for m in body.messages]

        async def render(tool_list: list[dict[str, Any]] | None) -> str:
            given = variables if tool_list is None else {**variables, "tools": tool_list}
            rendering = self.renderer.submit(render_chat, template, messages, add_generation, continue_final, given,
                                             CHARS_PER_TOKEN * self.max_model_len, timeout=RENDER_TIMEOUT_S)
            try:
                return await asyncio.wrap_future(rendering)
            except ChatTemplateError as exc:
                raise APIError(400, str(exc), param=param) from None
            except TimeoutError:
                raise APIError(400, f"the chat template took longer than {RENDER_TIMEOUT_S:g} s", param=param) from None
            except (MemoryError, WorkerError):
                raise APIError(400, "the chat template needed too much memory", param=param) from None

        tool_list = tools.tools if tools is not None else None
        text = await render(tool_list)
        if tool_list and tools.choice != "none" and text == await render(None):
            raise APIError(400, f'the chat template ignores tools (it renders the same prompt without them), so the '
                           f'model cannot see them; give a template that renders `tools` ({param}) or use tool_choice '
                           '"none"', param="tools")
        ids = await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=bool(body.add_special_tokens))
        return TokensPrompt(prompt_token_ids=ids, prompt=text)

    def _submissions(self, body, prompts: list[TokensPrompt], request_id: str,
                     params: SamplingParams | None = None) -> list[Submission]:
        """Each prompt's engine request (ids ``request_id-i`` for several), logged as vLLM logs them; ``params``
        when the endpoint made them, else the body's."""
        with _as_400():
            params = params or body.sampling_params(self.defaults, self.max_logprobs)
            submissions = []
            for i, prompt in enumerate(prompts):
                prompt_len = len(prompt["prompt_token_ids"])
                max_tokens = body.resolve_max_tokens(prompt_len, self.max_model_len, self.defaults,
                                                     self.settings.max_tokens_default)
                sampling = dataclasses.replace(params, max_tokens=max_tokens)
                engine_id = f"{request_id}-{i}" if len(prompts) > 1 else request_id
                if self.log_requests:
                    log.info("Received request %s: prompt tokens: %d, params: %s", engine_id, prompt_len,
                             _summary(sampling))
                submissions.append((prompt, sampling, engine_id, body.priority))
        return submissions

    async def _run(self, http: Request, submissions: list[Submission], started: Callable[[], None]) -> list[RequestOutput]:
        """All requests to their end, admitted together so the scheduler batches them; outputs in order. Aborted
        if the client disconnects first."""
        outputs: list[RequestOutput] = [None] * len(submissions)  # type: ignore[list-item]
        start = time.monotonic()

        async def collect() -> list[RequestOutput]:
            async for i, out in self.engine.generate_many(submissions):
                started()
                outputs[i] = out
                if out.finished:
                    self.metrics.observe_request(out, start)
            return outputs

        with _as_400():
            return await self._unless_disconnected(http, collect())

    # --- /v1/completions -----------------------------------------------------

    async def completions(self, body: CompletionRequest, http: Request) -> Response:
        with self._queued() as started:
            return await self._completions(body, http, started)

    async def _completions(self, body: CompletionRequest, http: Request, started: Callable[[], None]) -> Response:
        self.check_model(body.model)
        if body.suffix is not None:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.best_of not in (None, body.n):
            raise APIError(400, f"best_of must equal n ({body.n}): every sampled sequence is returned", param="best_of")
        tokens = await self._tokenized(body, body.prompts(), "prompt")
        request_id = self._request_id(body, http)
        response_id = f"cmpl-{request_id}"
        submissions = self._submissions(body, tokens, response_id)
        if body.stream:
            stream = self._stream_completion(body, submissions, response_id)
            return await self._start_stream(http, stream, request_id)
        outputs = await self._run(http, submissions, started)
        choices = [self._completion_choice(body, p * body.n + comp.index, out, comp)
                   for p, out in enumerate(outputs) for comp in out.outputs]
        usage = _usage(sum(len(o.prompt_token_ids) for o in outputs),
                       sum(len(c.token_ids) for o in outputs for c in o.outputs))
        return JSONResponse({"id": response_id, "object": "text_completion", "created": int(time.time()),
                             "model": self.model_name, "choices": choices, "usage": usage},
                            headers={"X-Request-Id": request_id})

    def _completion_choice(self, body: CompletionRequest, index: int, out: RequestOutput,
                           comp: CompletionOutput) -> dict[str, Any]:
        text, token_ids, entries = comp.text, comp.token_ids, comp.logprobs or []
        if body.echo:  # the prompt ahead of the completion, its logprobs too (the first token's is null)
            text, token_ids = out.prompt + text, out.prompt_token_ids + token_ids
            entries = (out.prompt_logprobs or []) + entries
        choice = {
            "index": index,
            "text": text,
            "logprobs": self._completion_logprobs(token_ids, entries, body.logprobs) if body.logprobs is not None else None,
            "finish_reason": comp.finish_reason,
            "stop_reason": comp.stop_reason,
        }
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = _prompt_logprobs(out)
        return choice

    def _top(self, entry: PositionLogprobs, n: int) -> list[tuple[str, float]]:
        """The top-n alternatives of one position, best first, as (token text, logprob)."""
        ranked = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= n), key=lambda lp: lp.rank)
        return [(lp.decoded_token, max(lp.logprob, MIN_LOGPROB)) for lp in ranked]

    def _token_text(self, token: int, entry: PositionLogprobs | None) -> str:
        decoded = entry[token].decoded_token if entry is not None else None
        return decoded if decoded is not None else self.tokenizer.decode([token], skip_special_tokens=False)

    def _completion_logprobs(self, token_ids: list[int], entries: list[PositionLogprobs | None], n: int,
                             offset: int = 0) -> dict[str, Any]:
        """OpenAI's completion logprobs; text_offset counts each token's text from ``offset``, as vLLM does."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in zip(token_ids, entries, strict=False):
            text = self._token_text(token, entry)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if entry is None else max(entry[token].logprob, MIN_LOGPROB))
            out["top_logprobs"].append(None if entry is None else dict(self._top(entry, n)))
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    def _stream_completion(self, body: CompletionRequest, submissions: list[Submission],
                           response_id: str) -> AsyncIterator[str]:
        def choice(out: RequestOutput, comp: CompletionOutput, sent: tuple[int, int] | None) -> list[dict[str, Any]]:
            chars, tokens = sent or (0, 0)
            text, token_ids, entries = comp.text[chars:], comp.token_ids[tokens:], (comp.logprobs or [])[tokens:]
            echo_now = body.echo and sent is None
            if not (text or comp.finish_reason or (echo_now and comp.token_ids)):  # wait for the prompt's prefill
                return []
            offset = chars + (len(out.prompt) if body.echo else 0)
            if echo_now:
                text, token_ids = out.prompt + text, out.prompt_token_ids + token_ids
                entries, offset = (out.prompt_logprobs or []) + entries, 0
            logprobs = (self._completion_logprobs(token_ids, entries, body.logprobs, offset)
                        if body.logprobs is not None else None)
            return [{"text": text, "logprobs": logprobs, "finish_reason": comp.finish_reason,
                     "stop_reason": comp.stop_reason}]

        return self._stream(submissions, response_id, "text_completion", choice, body.stream_options)

    # --- /v1/chat/completions ------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, http: Request) -> Response:
        with self._queued() as started:
            return await self._chat(body, http, started)

    async def _chat(self, body: ChatCompletionRequest, http: Request, started: Callable[[], None]) -> Response:
        self.check_model(body.model)
        with _as_400():
            tools = tool_request(body.tools, body.tool_choice, body.parallel_tool_calls, self.parsers)
        request_id = self._request_id(body, http)
        response_id = f"chatcmpl-{request_id}"
        prompt = await self._chat_prompt(body, tools)
        submissions = self._submissions(body, [prompt], response_id, self._chat_params(body, tools, prompt["prompt"]))
        n = submissions[0][1].logprobs
        if body.stream:
            return await self._start_stream(http, self._stream_chat(body, submissions, response_id, tools), request_id)
        (out,) = await self._run(http, submissions, started)
        choices = []
        for comp in out.outputs:
            message = OutputReader(self.parsers, tools, self.tokenizer).read(comp.text)
            choices.append({
                "index": comp.index,
                "message": self._message(message.reasoning, message.content, message.tool_calls),
                "logprobs": {"content": self._chat_logprobs(comp.token_ids, comp.logprobs or [], n)}
                if n is not None else None,
                "finish_reason": finish_reason(comp.finish_reason, bool(message.tool_calls)),
                "stop_reason": comp.stop_reason,
            })
        response = {"id": response_id, "object": "chat.completion", "created": int(time.time()),
                    "model": self.model_name, "choices": choices,
                    "usage": _usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))}
        if body.prompt_logprobs is not None:
            response["prompt_logprobs"] = _prompt_logprobs(out)
        return JSONResponse(response, headers={"X-Request-Id": request_id})

    def _chat_params(self, body: ChatCompletionRequest, tools: ToolRequest, prompt: str) -> SamplingParams:
        with _as_400():
            return chat_params(body.sampling_params(self.defaults, self.max_logprobs), tools, self.parsers, prompt,
                               self.engine.view)

    def _message(self, reasoning: str | None, content: str | None, calls: list) -> dict[str, Any]:
        """A whole message; reasoning_content with a reasoning parser, tool_calls when there are calls."""
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.parsers.reasoning_parser is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                     for c in calls]
        return message

    def _chat_logprobs(self, token_ids: list[int], entries: list[PositionLogprobs], n: int) -> list[dict[str, Any]]:
        out = []
        for token, entry in zip(token_ids, entries, strict=False):
            text = self._token_text(token, entry)
            out.append({
                "token": text,
                "logprob": max(entry[token].logprob, MIN_LOGPROB),
                "bytes": list(text.encode()),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in self._top(entry, n)],
            })
        return out

    def _stream_chat(self, body: ChatCompletionRequest, submissions: list[Submission], response_id: str,
                     tools: ToolRequest) -> AsyncIterator[str]:
        n = submissions[0][1].logprobs
        readers: dict[int, OutputReader] = {}
        fed: dict[int, int] = {}  # characters of each choice's text given to its reader (which may hold some back)

        def choice(_out: RequestOutput, comp: CompletionOutput, sent: tuple[int, int] | None) -> list[dict[str, Any]]:
            reader = readers.setdefault(comp.index, OutputReader(self.parsers, tools, self.tokenizer))
            text, fed[comp.index] = comp.text[fed.get(comp.index, 0) :], len(comp.text)
            deltas = _chat_deltas(reader.feed(text, final=comp.finish_reason is not None))
            if not deltas and comp.finish_reason is None:
                return []
            tokens = (sent or (0, 0))[1]
            logprobs = (
                {"content": self._chat_logprobs(comp.token_ids[tokens:], (comp.logprobs or [])[tokens:], n)}
                if n is not None else None
            )
            items = [{"delta": delta, "logprobs": None, "finish_reason": None} for delta in deltas or [{}]]
            items[0]["logprobs"] = logprobs
            items[-1]["finish_reason"] = finish_reason(comp.finish_reason, reader.made_calls)
            return items

        # OpenAI opens every choice with the assistant role.
        preamble = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                    for i in range(body.n)]
        return self._stream(submissions, response_id, "chat.completion.chunk", choice, body.stream_options, preamble)

    async def _stream(
        self,
        submissions: list[Submission],
        response_id: str,
        obj: str,
        choice: Callable[[RequestOutput, CompletionOutput, tuple[int, int] | None], list[dict[str, Any]]],
        stream_options: StreamOptions | None,
        preamble: list[dict[str, Any]] | None = None,
    ) -> AsyncIterator[str]:
        """Server-sent events: a chunk for each item ``choice`` returns for a choice (given the characters and tokens
        already sent, None before its first chunk), indexed prompt * n + sequence as OpenAI does; usage in every
        chunk with continuous_usage_stats, in a last one with include_usage; then [DONE]."""
        created = int(time.time())
        n = submissions[0][1].n
        continuous = stream_options is not None and stream_options.continuous_usage_stats

        def event(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
            data = {"id": response_id, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            return _sse(data if usage is None else {**data, "usage": usage})

        sent: dict[int, tuple[int, int]] = {}
        finals: dict[int, RequestOutput] = {}
        start = time.monotonic()
        async for p, out in self.engine.generate_many(submissions):
            if not finals and preamble is not None:
                yield event(preamble, _usage(len(out.prompt_token_ids), 0) if continuous else None)
            finals[p] = out
            for comp in out.outputs:
                index = p * n + comp.index
                items = choice(out, comp, sent.get(index))
                if not items:
                    continue
                sent[index] = (len(comp.text), len(comp.token_ids))
                for item in items:
                    yield event([{"index": index, **item}],
                                _usage(len(out.prompt_token_ids), len(comp.token_ids)) if continuous else None)
            if out.finished:
                self.metrics.observe_request(out, start)
        if stream_options is not None and stream_options.include_usage:
            yield event([], _usage(sum(len(o.prompt_token_ids) for o in finals.values()),
                                   sum(len(c.token_ids) for o in finals.values() for c in o.outputs)))
        yield "data: [DONE]\n\n"

    # --- /tokenize, /detokenize (vLLM's) ----------------------------------------

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        if body.messages is not None:
            ids = (await self._chat_prompt(body))["prompt_token_ids"]
        else:
            self._check_length(body.prompt)
            ids = await asyncio.to_thread(self.tokenizer.encode, body.prompt,
                                          add_special_tokens=body.add_special_tokens is not False)
        strs = [self.tokenizer.backend.id_to_token(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        vocab = self.tokenizer.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise APIError(400, f"tokens: token ids must be below the vocabulary size {vocab}", param="tokens")
        return {"prompt": await asyncio.to_thread(self.tokenizer.decode, body.tokens, skip_special_tokens=False)}

    # --- /v1/embeddings (fw_cli.server.embeddings) ------------------------------

    async def embeddings(self, body: EmbeddingRequest, http: Request) -> Response:
        with self._queued() as started:
            self.check_model(body.model)
            if "embed" not in self.engine.view.supported_tasks:
                raise APIError(400, f"The model `{self.model_name}` does not support the Embeddings API: it cannot "
                               "pool its hidden states", param="model")
            prompts = await self._tokenized(body, body.inputs(), "input")
            request_id = self._request_id(body, http)
            response_id = f"embd-{request_id}"
            params = pooling_params(body)
            submissions = [(prompt, params, f"{response_id}-{i}" if len(prompts) > 1 else response_id, body.priority)
                           for i, prompt in enumerate(prompts)]
            outputs = await self._run(http, submissions, started)
            return JSONResponse(embedding_response(body, outputs, self.model_name, response_id),
                                headers={"X-Request-Id": request_id})

    # --- helpers --------------------------------------------------------------

    async def _start_stream(self, http: Request, stream: AsyncIterator[str], request_id: str) -> StreamingResponse:
        """Admit the request before answering 200, so that a bad request still gets its 400; an error after that
        ends the stream with an error event, as vLLM sends it."""
        with _as_400():
            first = await self._unless_disconnected(http, stream.__anext__())

        async def body() -> AsyncIterator[str]:
            yield first
            try:
                async for item in stream:
                    yield item
            except Exception as exc:  # noqa: BLE001 - the status is sent: the error goes in the stream
                yield _sse(_api_error(exc, request_id).body())
                yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream", headers={"X-Request-Id": request_id})


def _chat_deltas(delta: ChatDelta) -> list[dict[str, Any]]:
    """A reader's news as chunk deltas: reasoning and content together, then each tool-call piece in its own
    (OpenAI's shape: a call's first piece has its id, type and name, with arguments "", then its arguments)."""
    text = {key: value for key, value in (("reasoning_content", delta.reasoning), ("content", delta.content)) if value}
    calls = [
        {"tool_calls": [{"index": c.index, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}
                        if c.id is not None else {"index": c.index, "function": {"arguments": c.arguments}}]}
        for c in delta.calls
    ]
    return ([text] if text else []) + calls


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _prompt_logprobs(out: RequestOutput) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: per prompt token, {token id: {logprob, rank, decoded_token}} (the first null)."""
    return [
        None if entry is None
        else {str(t): {**dataclasses.asdict(lp), "logprob": max(lp.logprob, MIN_LOGPROB)} for t, lp in entry.items()}
        for entry in out.prompt_logprobs or []
    ]


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def build_app(server: Server) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        server.engine.shutdown()

    # max_body_size: a larger body is refused by its Content-Length, or once that many bytes came, before parsing.
    app = FastAPI(title="Flywheel", version=__version__, lifespan=lifespan,
                  max_body_size=server.settings.max_request_bytes)
    app.add_middleware(_Guard, server=server)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        err = _validation_error(exc)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail)
        if exc.status_code == 413:
            message = f"the request body is larger than {server.settings.max_request_bytes} bytes (--max-request-bytes)"
        return JSONResponse(APIError(exc.status_code, message, kind).body(), status_code=exc.status_code)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if server.draining else 200)  # a load balancer stops routing here

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": server.model_name, "object": "model", "created": server.created, "owned_by": "fw",
                      "max_model_len": server.max_model_len,
                      "supported_tasks": list(server.engine.view.supported_tasks)}],  # vLLM's task names
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await server.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await server.detokenize(body)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await server.embeddings(body, request)

    return app


class _Guard:
    """Our outermost middleware: the API key first; then any exception a handler lets out becomes an
    OpenAI-shaped 500 with a request id (its traceback logged), never a plain-text one."""

    def __init__(self, app: Callable, server: Server) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        if (refusal := self.server.authenticate(request)) is not None:
            return await refusal(scope, receive, send)
        responded = False

        async def watched_send(message: dict) -> None:
            nonlocal responded
            responded = responded or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception as exc:
            if responded:  # too late for a status: the connection just ends
                raise
            request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
            error = _api_error(exc, request_id)
            response = JSONResponse(error.body(), status_code=error.status, headers={"X-Request-Id": request_id})
            await response(scope, receive, send)


class _GracefulServer(uvicorn.Server):
    """SIGTERM/SIGINT: drain, then exit 0 (uvicorn re-raises the signal). While requests are still generating
    the server keeps listening, answering new ones 503 with Retry-After (and /health 503) so that clients and
    load balancers move on rather than meet a refused connection; then uvicorn closes the listener."""

    def __init__(self, config: uvicorn.Config, server: Server) -> None:
        super().__init__(config)
        self.fw_server = server
        self.drain_deadline = 0.0

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.fw_server.draining:
            self.drain_deadline = time.monotonic() + (self.config.timeout_graceful_shutdown or 0)
        self.fw_server.draining = True
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        should_exit = await super().on_tick(counter)
        if should_exit and not self.force_exit and time.monotonic() < self.drain_deadline:
            return not self.fw_server.engine.has_unfinished_requests()
        return should_exit

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run(server: Server, host: str, port: int, log_level: str = "info") -> None:
    """Serve until SIGTERM/SIGINT; uvicorn logs at ``log_level`` (info: a line per HTTP request)."""
    config = uvicorn.Config(build_app(server), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30)
    _GracefulServer(config, server).run()
