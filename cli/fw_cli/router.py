"""``fw router``: an OpenAI-compatible proxy in front of prefill and decode instances (disaggregated serving).

A completion or chat request goes first to a prefill instance as itself with ``max_tokens`` 1 and no stream, so
that the instance computes the prompt's KV and its KV connector, in the producer role, keeps it. The unchanged
request then goes to a decode instance, whose connector (consumer) loads that KV instead of computing it; the
decode instance's answer, streamed or not, is the client's. A ``kv_transfer_params`` object in the prefill
answer travels with the decode request (vLLM's convention), for connectors that need to say where the KV is.

Instances are taken round-robin, healthy ones first. One that refuses the connection or answers 5xx is marked
unhealthy and the request moves to the next; a health check (``GET /health``) every few seconds brings it back.
A client error (4xx) is the client's answer as it is. With no prefill instance answering, the decode instance
computes the prompt itself; with no decode instance answering, the client gets a 503 in OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fw_cli.server.protocol import APIError

log = logging.getLogger("fw.router")

# Client headers the instances see: the API key and the request id.
FORWARDED_HEADERS = ("authorization", "x-request-id")
# A prefill answer is one token: drop what would stream it or make it longer.
PREFILL_DROPPED = ("stream", "stream_options", "min_tokens", "max_completion_tokens")


class Unavailable(Exception):
    """An instance failed in a way another instance may not: refused, reset, timed out, or answered 5xx."""


@dataclass
class Instance:
    url: str
    healthy: bool = True


class Pool:
    """One role's instances, handed out round-robin."""

    def __init__(self, role: str, urls: list[str]) -> None:
        self.role = role
        self.instances = [Instance(u.rstrip("/")) for u in urls]
        self._turn = itertools.count()

    def order(self) -> list[Instance]:
        """Every instance, starting at the next in turn: the healthy first, then the others (a health check may be
        behind; trying a dead one costs one refused connection)."""
        start = next(self._turn) % len(self.instances)
        ring = self.instances[start:] + self.instances[:start]
        return [i for i in ring if i.healthy] + [i for i in ring if not i.healthy]


class Router:
    def __init__(self, prefill: list[str], decode: list[str], timeout: float = 600.0,
                 health_interval: float = 2.0) -> None:
        if not decode:
            raise ValueError("fw router needs at least one --decode URL")
        self.prefill, self.decode = Pool("prefill", prefill), Pool("decode", decode)
        self.health_interval = health_interval
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0))

    async def check_health(self) -> None:
        for instance in self.prefill.instances + self.decode.instances:
            try:
                instance.healthy = (await self.client.get(f"{instance.url}/health", timeout=2.0)).status_code == 200
            except httpx.HTTPError:
                instance.healthy = False

    async def health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.health_interval)

    async def _post(self, instance: Instance, path: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
        """POST and read the whole answer; a transport failure or a 5xx is ``Unavailable``."""
        try:
            response = await self.client.post(f"{instance.url}{path}", json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise Unavailable(f"{instance.url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500:
            raise Unavailable(f"{instance.url}: HTTP {response.status_code}")
        return response

    async def prefill_step(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response | None:
        """Have a prefill instance compute the prompt. Returns its answer (a 4xx ends the request there), or None
        when no prefill instance answered."""
        one_token = {k: v for k, v in body.items() if k not in PREFILL_DROPPED} | {"max_tokens": 1}
        for instance in self.prefill.order():
            try:
                return await self._post(instance, path, one_token, headers)
            except Unavailable as exc:
                instance.healthy = False
                log.warning("fw router: prefill instance unavailable (%s); trying the next", exc)
        if self.prefill.instances:
            log.warning("fw router: no prefill instance answered; the decode instance computes the prompt")
        return None

    async def decode_step(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        errors = []
        for instance in self.decode.order():
            try:
                if body.get("stream"):
                    return await self._stream(instance, path, body, headers)
                response = await self._post(instance, path, body, headers)
                return Response(response.content, status_code=response.status_code,
                                media_type=response.headers.get("content-type"))
            except Unavailable as exc:
                instance.healthy = False
                errors.append(str(exc))
                log.warning("fw router: decode instance unavailable (%s); trying the next", exc)
        raise APIError(503, f"no decode instance could take the request ({'; '.join(errors)})",
                       "service_unavailable", headers={"Retry-After": "1"})

    async def _stream(self, instance: Instance, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        """Open the decode instance's stream; once it has answered, its events are the client's. A stream cut
        short ends with an error event, as the server's own do."""
        request = self.client.build_request("POST", f"{instance.url}{path}", json=body, headers=headers)
        try:
            upstream = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise Unavailable(f"{instance.url}: {type(exc).__name__}: {exc}") from exc
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            if upstream.status_code >= 500:
                raise Unavailable(f"{instance.url}: HTTP {upstream.status_code}")
            return Response(content, status_code=upstream.status_code, media_type=upstream.headers.get("content-type"))

        async def events() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:
                error = APIError(502, f"the decode instance {instance.url} broke off: {type(exc).__name__}",
                                 "service_unavailable")
                yield f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
            finally:
                await upstream.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def handle(self, path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            raise APIError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        prefilled = await self.prefill_step(path, body, headers)
        if prefilled is not None and prefilled.status_code != 200:
            return Response(prefilled.content, status_code=prefilled.status_code,
                            media_type=prefilled.headers.get("content-type"))
        params = prefilled.json().get("kv_transfer_params") if prefilled is not None else None
        return await self.decode_step(path, {**body, "kv_transfer_params": params} if params else body, headers)


def build_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        task = asyncio.create_task(router.health_loop())
        yield
        task.cancel()
        await router.client.aclose()

    app = FastAPI(title="fw router", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        for instance in router.decode.order():
            with contextlib.suppress(httpx.HTTPError):
                response = await router.client.get(f"{instance.url}/v1/models", headers=headers)
                return Response(response.content, status_code=response.status_code,
                                media_type=response.headers.get("content-type"))
        raise APIError(503, "no decode instance answered", "service_unavailable")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if any(i.healthy for i in router.decode.instances) else 503)

    return app
