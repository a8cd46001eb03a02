"""The OpenAI-compatible HTTP server behind `fw serve`."""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fw import __version__
from fw.async_engine import AsyncEngine
from fw.chat import ChatTemplateError, apply_chat_template, load_template
from fw.engine import EngineError
from fw.outputs import CompletionOutput, RequestOutput
from fw.sampling_params import SamplingParamsError
from fw_cli.server.metrics import Metrics
from fw_cli.server.protocol import APIError, ChatCompletionRequest, CompletionRequest


def _validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0]
    loc = [str(p) for p in first["loc"] if p != "body"]
    if first["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first['msg']}")
    if first["type"] == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {loc[-1]}", param=loc[-1])
    return APIError(400, f"{'.'.join(loc) or 'body'}: {first['msg']}", param=".".join(loc) or None)


class Server:
    def __init__(self, engine: AsyncEngine, served_model_name: str, api_key: str | None, chat_template: str | None):
        self.engine = engine
        self.model_name = served_model_name
        self.api_key = api_key
        self.chat_template = load_template(chat_template)
        self.metrics = Metrics(engine.engine)
        self.created = int(time.time())

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "NotFoundError", "model", "model_not_found")

    async def _collect(self, prompt, params, request_id: str) -> RequestOutput:
        final = None
        async for output in self.engine.generate(prompt, params, request_id):
            final = output
        return final

    def _sampling(self, body, max_tokens, logprobs, response_format=None):
        try:
            return body.sampling_params(max_tokens, logprobs, response_format)
        except SamplingParamsError as exc:
            raise APIError(400, str(exc), param=exc.field) from None

    # --- /v1/completions -----------------------------------------------------

    async def completions(self, body: CompletionRequest, http: Request) -> Response:
        self.check_model(body.model)
        params = self._sampling(body, body.max_tokens, body.logprobs)
        prompts = body.prompts()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            if len(prompts) != 1:
                raise APIError(400, "streaming takes a single prompt", param="prompt")
            stream = self._stream_completion(body, prompts[0], params, request_id, http)
            return await self._start_stream(stream)
        outputs = []
        for i, prompt in enumerate(prompts):
            start = time.monotonic()
            outputs.append(await self._guarded(self._collect(prompt, params, f"{request_id}-{i}")))
            self.metrics.observe_request(outputs[-1], start)
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for p_index, out in enumerate(outputs):
            prompt_tokens += len(out.prompt_token_ids)
            for comp in out.outputs:
                completion_tokens += len(comp.token_ids)
                text = (out.prompt or "") + comp.text if body.echo else comp.text
                choices.append(
                    {
                        "index": p_index * params.n + comp.index,
                        "text": text,
                        "logprobs": self._completion_logprobs(comp, body.logprobs) if body.logprobs is not None else None,
                        "finish_reason": comp.finish_reason,
                        "stop_reason": comp.stop_reason,
                    }
                )
        return JSONResponse(
            {
                "id": request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": _usage(prompt_tokens, completion_tokens),
            }
        )

    def _top(self, entry: dict[int, tuple[float, int]], n: int) -> list[tuple[str, float]]:
        """The top-n alternatives of one position, best first, as (token text, logprob)."""
        decode = self.engine.engine.tokenizer.decode
        ranked = sorted((kv for kv in entry.items() if kv[1][1] <= n), key=lambda kv: kv[1][1])
        return [(decode([token], skip_special_tokens=False), lp) for token, (lp, _rank) in ranked]

    def _completion_logprobs(self, comp: CompletionOutput, n: int, start: int = 0) -> dict[str, Any]:
        decode = self.engine.engine.tokenizer.decode
        entries = comp.logprobs[start:] if comp.logprobs else []
        token_ids = comp.token_ids[start : start + len(entries)]
        return {
            "tokens": [decode([t], skip_special_tokens=False) for t in token_ids],
            "token_logprobs": [e[t][0] for t, e in zip(token_ids, entries, strict=True)],
            "top_logprobs": [dict(self._top(e, n)) for e in entries],
            "text_offset": [],
        }

    async def _stream_completion(self, body, prompt, params, request_id, http) -> AsyncIterator[str]:
        def choice(comp: CompletionOutput, delta: str, first_token: int) -> dict[str, Any]:
            logprobs = self._completion_logprobs(comp, params.logprobs, first_token) if params.logprobs is not None else None
            return {"index": comp.index, "text": delta, "logprobs": logprobs, "finish_reason": comp.finish_reason}

        async for item in self._stream(prompt, params, request_id, "text_completion", choice, body.stream_options):
            yield item

    # --- /v1/chat/completions ------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, http: Request) -> Response:
        self.check_model(body.model)
        if body.tools or body.tool_choice not in (None, "none"):
            raise APIError(400, "tool calling is not supported by this server", param="tools")
        params = self._sampling(body, body.token_limit(), body.num_logprobs(), body.response_format)
        tokenizer = self.engine.engine.tokenizer
        try:
            text = apply_chat_template(
                tokenizer,
                [m.flat() for m in body.messages],
                body.add_generation_prompt,
                load_template(body.chat_template) or self.chat_template,
                **(body.chat_template_kwargs or {}),
            )
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages") from None
        prompt = tokenizer.encode(text, add_special_tokens=False)
        if params.max_tokens is None:
            # OpenAI's default: as many as the context allows.
            params.max_tokens = max(self.engine.engine.max_model_len - len(prompt), 1)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return await self._start_stream(self._stream_chat(body, prompt, params, request_id))
        start = time.monotonic()
        out = await self._guarded(self._collect(prompt, params, request_id))
        self.metrics.observe_request(out, start)
        choices = [
            {
                "index": comp.index,
                "message": {"role": "assistant", "content": comp.text},
                "logprobs": {"content": self._chat_logprobs(comp, params.logprobs)} if params.logprobs is not None else None,
                "finish_reason": comp.finish_reason,
                "stop_reason": comp.stop_reason,
            }
            for comp in out.outputs
        ]
        usage = _usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))
        return JSONResponse({"id": request_id, "object": "chat.completion", "created": int(time.time()),
                             "model": self.model_name, "choices": choices, "usage": usage})

    def _chat_logprobs(self, comp: CompletionOutput, n: int, start: int = 0) -> list[dict[str, Any]]:
        decode = self.engine.engine.tokenizer.decode
        entries = comp.logprobs[start:] if comp.logprobs else []
        out = []
        for token, entry in zip(comp.token_ids[start:], entries, strict=False):
            text = decode([token], skip_special_tokens=False)
            out.append({
                "token": text,
                "logprob": entry[token][0],
                "bytes": list(text.encode()),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in self._top(entry, n)],
            })
        return out

    async def _stream_chat(self, body, prompt, params, request_id) -> AsyncIterator[str]:
        def choice(comp: CompletionOutput, delta: str, first_token: int) -> dict[str, Any]:
            logprobs = (
                {"content": self._chat_logprobs(comp, params.logprobs, first_token)}
                if params.logprobs is not None else None
            )
            return {"index": comp.index, "delta": {"content": delta} if delta else {}, "logprobs": logprobs,
                    "finish_reason": comp.finish_reason}

        # OpenAI opens every choice with the assistant role.
        preamble = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                    for i in range(params.n)]
        stream = self._stream(prompt, params, request_id, "chat.completion.chunk", choice, body.stream_options, preamble)
        async for item in stream:
            yield item

    async def _stream(self, prompt, params, request_id, obj, choice, stream_options, preamble=None):
        """Server-sent events: one chunk per new text of a choice, then usage if asked, then [DONE]."""

        def event(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
            data = {"id": request_id, "object": obj, "created": self.created, "model": self.model_name,
                    "choices": choices}
            return _sse(data if usage is None else {**data, "usage": usage})

        sent_text, sent_tokens = [0] * params.n, [0] * params.n
        start = time.monotonic()
        final = None
        async for out in self.engine.generate(prompt, params, request_id):
            if final is None and preamble is not None:
                yield event(preamble)
            final = out
            for comp in out.outputs:
                delta = comp.text[sent_text[comp.index] :]
                if not delta and comp.finish_reason is None:
                    continue
                yield event([choice(comp, delta, sent_tokens[comp.index])])
                sent_text[comp.index], sent_tokens[comp.index] = len(comp.text), len(comp.token_ids)
        self.metrics.observe_request(final, start)
        if stream_options and stream_options.include_usage:
            yield event([], _usage(len(final.prompt_token_ids), sum(len(c.token_ids) for c in final.outputs)))
        yield "data: [DONE]\n\n"

    # --- helpers --------------------------------------------------------------

    async def _guarded(self, awaitable):
        """Run an engine call, turning request errors into 400s."""
        try:
            return await awaitable
        except (EngineError, SamplingParamsError) as exc:
            raise APIError(400, str(exc), param=getattr(exc, "field", None)) from None

    async def _start_stream(self, stream: AsyncIterator[str]) -> StreamingResponse:
        """Admit the request before answering 200, so that a bad request still gets its 400."""
        first = await self._guarded(stream.__anext__())

        async def body() -> AsyncIterator[str]:
            yield first
            async for item in stream:
                yield item

        return StreamingResponse(body(), media_type="text/event-stream")


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def build_app(server: Server) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        server.engine.shutdown()

    app = FastAPI(title="Flywheel", version=__version__, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        err = _validation_error(exc)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, str(exc.detail), kind).body(), status_code=exc.status_code)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if server.api_key and request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            if not secrets.compare_digest(header.encode(), f"Bearer {server.api_key}".encode()):
                err = APIError(401, "Incorrect API key provided.", "AuthenticationError", code="invalid_api_key")
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

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
                      "max_model_len": server.engine.engine.max_model_len}],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat(body, request)

    return app


class _GracefulServer(uvicorn.Server):
    """SIGTERM/SIGINT: stop accepting, let in-flight requests finish, then exit 0 (uvicorn re-raises the signal)."""

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run(server: Server, host: str, port: int) -> None:
    config = uvicorn.Config(build_app(server), host=host, port=port, log_level="warning", timeout_graceful_shutdown=30)
    _GracefulServer(config).run()
