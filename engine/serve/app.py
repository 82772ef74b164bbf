"""The OpenAI-compatible HTTP API over one Engine: a Starlette app, served by uvicorn.

Every request is checked in full before anything is queued; a refusal is a 4xx in OpenAI's
error JSON shape with a message that says what to fix. A client that goes away (mid-stream
or while waiting for a whole answer) aborts its request, which frees its KV pages.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from operator import attrgetter
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.config import shown
from engine.facade.engine import Engine, RequestFailed
from engine.facade.recorder import TraceBusy
from engine.errors import ConfigError, InvalidRequest, TokentopError, describe_error
from engine.serve import protocol as P
from engine.serve.body import read_body
from engine.serve.metrics import CONTENT_TYPE, EngineMetrics
from engine.serve.router_api import RouterApi
from engine.serve.snapshot_json import snapshot_json
from engine.serve.openapi import openapi_schema
from engine.serve.request_metrics import response_metrics
from engine.serve.routes import ApiRoute, route_table

# Prompts are tokenized on a few threads of their own: the BPE of a long prompt needs ~25x its
# size in memory while it runs, so concurrent ones are bounded by the cores, not the clients
TOKENIZE_THREADS = min(4, os.cpu_count() or 1)


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None            # Bearer token for the keyed routes (routes.py); health and metrics stay open
    max_queue: int = 256                  # requests waiting beyond what the workers can run at once
    max_body: int = 4 * 2**20             # bytes
    allowed_hosts: tuple[str, ...] = ()   # Host header names accepted besides the loopback ones
    header_timeout: float = 10.0          # seconds for a request's line and headers to arrive
    body_timeout: float = 30.0            # seconds for its whole body
    per_request_metrics: bool = False     # a `metrics` object on each response (request_metrics.py)

    def check(self) -> "ServeConfig":
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("`api_key` is empty: give the key clients must send, or leave it out to "
                              "serve without one")
        if not self.host.strip():
            raise ConfigError("`host` is empty (that would listen on every address): give one, e.g. "
                              "127.0.0.1, or 0.0.0.0 to listen on all of them on purpose")
        return self

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    def exposure_warning(self) -> str | None:
        """What to say when the API listens beyond this machine with no key."""
        if self.loopback or self.api_key:
            return None
        return (f"listening on {self.host} without an API key: anyone who can reach this address can run "
                "the model, read /metrics and fill its queue; set `api_key` or listen on 127.0.0.1")


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def served_names(engine: Engine) -> list[str]:
    """The model ids clients may ask for: the `model` value; for a file, its name without the
    directory or .gguf (a path would tell clients about the server's disk)."""
    model = engine.config.workers[0].model
    return [Path(model).stem] if model.endswith(".gguf") else [model]


class HostCheck:
    """ASGI middleware: a server on loopback answers only requests whose Host header names it
    (localhost, the bound address, or an `allowed_hosts` name), so a web page whose own name
    was re-pointed at 127.0.0.1 (DNS rebinding) cannot talk to it through the browser."""

    def __init__(self, app, allowed: frozenset[str], refuse) -> None:
        self.app, self.allowed, self.refuse = app, allowed, refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host")
            name = host_name(host.decode("latin-1")) if host else None
            if name is not None and name not in self.allowed:
                response = self.refuse(P.ApiError(
                    403, f"this server does not answer to the host name {name!r}; reach it as "
                         f"{', '.join(sorted(self.allowed))}, or add {name} to `allowed_hosts`",
                    type="permission_error", code="host_not_allowed"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def host_name(header: str) -> str:
    """'Example.COM:8000' -> 'example.com', '[::1]:8000' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0].rstrip(".") if header.count(":") == 1 else header.rstrip(".")


def allowed_host_names(config: ServeConfig) -> frozenset[str] | None:
    """Host header names a server on loopback answers to; None = any (it listens beyond)."""
    if not config.loopback:
        return None
    names = {"localhost", "127.0.0.1", "::1", host_name(config.host)}
    return frozenset(names | {host_name(h) for h in config.allowed_hosts})


class OpenAIServer:
    def __init__(self, engine: Engine, config: ServeConfig = ServeConfig()):
        self.engine = engine
        self.config = config.check()
        self.names = served_names(engine)
        self.model = self.names[0]
        self.metrics = EngineMetrics(engine, self.model)
        self.schema = openapi_schema(self.names)
        self.router = RouterApi(self)      # what vllm-router and SGLang's gateway ask a worker
        self.routes = route_table(self.names)
        self._tokenizing = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokentop-tokenize")
        allowed = allowed_host_names(self.config)
        self.app = Starlette(routes=[Route(r.path, self._endpoint(r), methods=[r.method]) for r in self.routes],
                             middleware=[Middleware(HostCheck, allowed=allowed, refuse=self.error)] if allowed else [],
                             exception_handlers={404: self._not_found, 405: self._not_allowed,
                                                 Exception: self._internal})

    def _endpoint(self, route: ApiRoute):
        """The route's handler, behind the key check when the route needs the key; a refusal
        (ApiError) from either is answered in OpenAI's error shape."""
        handler = attrgetter(route.handler)(self)

        async def endpoint(request: Request) -> Response:
            try:
                if route.keyed:
                    self.check_key(request)
                return await handler(request)
            except P.ApiError as exc:
                return self.error(exc)
        return endpoint

    def close(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    # --- small endpoints ----------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.engine.ready:
            return JSONResponse({"status": "ok"})
        snap = self.engine.snapshot()
        if snap.workers and all(w.state in ("dead", "stopped") for w in snap.workers):
            return JSONResponse({"status": "dead", "message": "every worker has stopped"}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def write_trace(self, request: Request) -> Response:
        """POST /trace: write the flight recorder's last window (every worker's ring) as a
        Perfetto trace in the server's --trace-dir (default ./traces); {"path": where}. Needs
        the API key when one is set: the file lands on the server's disk. 429 with Retry-After
        while one is being written or right after; the folder keeps the newest --trace-keep."""
        try:
            path = await asyncio.to_thread(self.engine.export_trace, refuse_busy=True)
        except TraceBusy as exc:     # one at a time, and not faster than one is written
            response = self.error(P.ApiError(429, str(exc), type="rate_limit_error", code="trace_busy"))
            response.headers["Retry-After"] = str(exc.retry_after)
            return response
        except TokentopError as exc:
            raise P.ApiError(500, str(exc), type="server_error", code="trace_not_written") from None
        self.engine.log("info", f"trace written to {path} (POST /trace)")
        return JSONResponse({"path": path})

    async def snapshot(self, request: Request) -> Response:
        """The engine's snapshot as versioned JSON (engine/serve/snapshot_json.py, docs/snapshot.md)."""
        return JSONResponse(snapshot_json(self.engine.snapshot()))

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(self.schema)

    async def models(self, request: Request) -> Response:
        _, ctx = self.engine.capacity()
        created = int(time.time())
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "tokentop",
             "max_model_len": ctx or None} for name in self.names]})

    async def tokenize(self, request: Request) -> Response:
        """vLLM's POST /tokenize: {"model", "prompt"} or {"model", "messages"} -> {"count", "tokens"}.
        Another tokentop with a remote worker here that serves a different model asks it for prompt
        lengths; the count is what /v1/completions and /v1/chat/completions would feed the model."""
        body = await self.read_json(request)
        if not isinstance(body, dict):
            raise P.ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model not in self.names:
            raise P.ApiError(404, f"model {shown(model)} does not exist here; GET /v1/models lists "
                                  f"{', '.join(map(repr, self.names))}", "model", code="model_not_found")
        if ("prompt" in body) == ("messages" in body):
            raise P.ApiError(400, "send exactly one of 'prompt' (text or token ids) or 'messages'")
        if self.engine.tokenizer is None:
            raise P.ApiError(503, "the model is still loading; retry when GET /health answers 200",
                             type="service_unavailable", code="loading")
        parsed = (P.parse_chat({"messages": body["messages"]}) if "messages" in body
                  else P.parse_completion({"prompt": body["prompt"]}))
        ids = await self._tokenize(parsed)
        _, ctx = self.engine.capacity()
        return JSONResponse({"count": len(ids), "max_model_len": ctx or None, "tokens": ids, "token_strs": None})

    async def _not_found(self, request: Request, exc) -> Response:
        offered = [f"{r.method} {r.path}" for r in self.routes]
        return self.error(P.ApiError(404, f"no route {request.url.path}; this server offers "
                                          f"{', '.join(offered[:-1])} and {offered[-1]}", code="not_found"))

    async def _internal(self, request: Request, exc: Exception) -> Response:
        # a bug here must still answer in the API's shape, and show in the engine's log
        self.engine.log("error", f"http: {request.url.path}: {describe_error(exc)}")
        return self.error(P.ApiError(500, f"internal error: {describe_error(exc)}",
                                      type="server_error", code="internal_error"))

    async def _not_allowed(self, request: Request, exc) -> Response:
        return self.error(P.ApiError(405, f"{request.method} is not allowed on {request.url.path}"))

    # --- completions --------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, P.parse_completion)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, P.parse_chat)

    async def _generate(self, request: Request, parse) -> Response:
        parsed = parse(await self.read_json(request))
        ids = await self.encode(parsed)
        lens = await self._prompt_lengths(parsed, ids)
        handle, parsed, n_prompt = self._submit(parsed, ids, lens)
        rid, created = P.new_id(parsed.kind), P.now()
        if parsed.stream:
            return StreamingResponse(self._stream(handle, parsed, n_prompt, rid, created),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._whole(request, handle, parsed, n_prompt, rid, created)

    async def encode(self, p: P.Parsed) -> list[int]:
        """The prompt's ids, once the model asked for is this one and the engine is ready."""
        if p.model is not None and p.model not in self.names:
            raise P.ApiError(404, f"model {shown(p.model)} does not exist here; GET /v1/models lists "
                                  f"{', '.join(map(repr, self.names))}", "model", code="model_not_found")
        if not self.engine.ready:
            workers = self.engine.snapshot().workers
            if workers and all(w.state in ("dead", "stopped") for w in workers):
                raise P.ApiError(503, "every worker of this server has stopped; see its log",
                                 type="service_unavailable", code="no_worker")
            raise P.ApiError(503, "the model is still loading; retry when GET /health answers 200",
                             type="service_unavailable", code="loading")
        return await self._tokenize(p)

    async def _tokenize(self, p: P.Parsed) -> list[int]:
        """The prompt's ids, encoded on a tokenizing thread (the tokenizer releases the GIL:
        other streams go on); a text too long for the context by its length alone is refused
        unread."""
        field = "messages" if p.kind == "chat" else "prompt"
        _, ctx = self.engine.capacity()
        chars = len(p.prompt or "") + sum(len(m["content"]) for m in p.messages or ()
                                          if isinstance(m, dict) and isinstance(m.get("content"), str))
        tok = self.engine.tokenizer
        if ctx and chars > ctx * tok.max_token_bytes:
            # no token stands for more than max_token_bytes bytes, and a character is >= 1 byte
            raise P.ApiError(400, f"the {field} has {chars:,} characters: more than the {ctx}-token context "
                                  f"can hold ({tok.max_token_bytes} bytes a token at most); shorten it",
                             field, code="context_length_exceeded")
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._tokenizing, self.engine.encode, p.prompt, p.messages, p.prompt_ids)
        except InvalidRequest as exc:
            raise P.ApiError(400, str(exc), field) from None

    async def _prompt_lengths(self, p: P.Parsed, ids: list[int]) -> dict:
        """The prompt's length on remote workers of another model: their /tokenize is asked off the
        event loop (bounded by a short timeout), so other streams never wait on it."""
        if self.engine.needs_remote_counts():
            return await asyncio.to_thread(self.engine.prompt_lengths, ids, p.messages)
        return self.engine.prompt_lengths(ids, p.messages)     # no HTTP: estimates at most

    def _submit(self, p: P.Parsed, ids: list[int], lens: dict):
        """Every check that depends on the engine's state, then submit: no await in between."""
        capacity, ctx = self.engine.capacity()
        room = ctx - len(ids)
        if room < 1:
            raise P.ApiError(400, f"the prompt has {len(ids)} tokens but the context is {ctx} tokens; "
                                  "shorten the prompt", "messages" if p.kind == "chat" else "prompt",
                             code="context_length_exceeded")
        mt = p.params.max_tokens
        if p.max_tokens_given and mt > room:
            name = p.max_tokens_given if isinstance(p.max_tokens_given, str) else "max_tokens"
            raise P.ApiError(400, f"{name} {mt} plus the prompt's {len(ids)} tokens exceed the context "
                                  f"of {ctx} tokens; ask for at most {room}", name, code="context_length_exceeded")
        if not p.max_tokens_given:
            # OpenAI's defaults: 16 for completions, as much as fits for chat
            mt = min(16, room) if p.kind == "completion" else room
            p = replace(p, params=replace(p.params, max_tokens=mt))
        waiting = max(0, self.engine.outstanding() - capacity)    # this one would wait behind them
        if self.engine.outstanding() >= capacity and waiting + 1 > self.config.max_queue:
            raise P.ApiError(429, f"{waiting} requests are already waiting for a free slot (`max_queue="
                                  f"{self.config.max_queue}`); retry later", type="rate_limit_error",
                             code="queue_full")
        try:
            handle = self.engine.submit(prompt_ids=ids, messages=p.messages, params=p.params, prompt_lengths=lens)
        except InvalidRequest as exc:
            raise P.ApiError(400, str(exc), P.param_of(str(exc))) from None
        except TokentopError as exc:
            raise P.ApiError(503, str(exc), type="service_unavailable") from None
        return handle, p, len(ids)

    async def _stream(self, handle, p: P.Parsed, n_prompt: int, rid: str, created: int):
        fmt = P.LogprobFormatter(self.engine.tokenizer, p.kind, p.top_logprobs) if p.logprobs else None
        pending = []
        first = True
        try:
            try:
                async for d in handle:
                    pending.append(d)
                    if not d.text and not first:
                        continue       # a token with no text yet (a held-back stop or split char)
                    yield _sse(self._chunk(p, rid, created, pending, fmt, first, None))
                    pending, first = [], False
                result = handle.result(0)
                finish = result.finish_reason
                last = self._chunk(p, rid, created, pending, fmt, first, finish)
                if p.include_usage:
                    yield _sse(last)
                    n_out = result.metrics.output_tokens if result.metrics else len(result.token_ids)
                    last = P.usage_chunk(rid, self.model, created, p.kind,
                                         P.usage(_prompt_tokens(result, n_prompt), n_out))
                yield _sse(self._with_metrics(last, result))   # on the usage chunk, if there is one
            except RequestFailed as exc:
                yield _sse({"error": {"message": str(exc), "type": "server_error", "param": None,
                                      "code": "request_failed"}})
            yield "data: [DONE]\n\n"
        finally:
            if not handle.done:          # the client went away (or the server is stopping)
                self.engine.abort(handle.id)

    def _chunk(self, p, rid, created, deltas, fmt, first, finish) -> dict:
        text = "".join(d.text for d in deltas)
        lp = fmt.block(fmt.entries(deltas)) if fmt is not None else None
        ids = [d.token_id for d in deltas if d.token_id >= 0] if p.return_token_ids else None
        return P.chunk_body(rid, self.model, created, p.kind, text, finish, lp, first=first, token_ids=ids,
                            with_usage_field=p.include_usage)

    async def _whole(self, request: Request, handle, p: P.Parsed, n_prompt: int, rid: str, created: int):
        watcher = asyncio.ensure_future(self._abort_on_disconnect(request, handle))
        deltas = []
        try:
            async for d in handle:
                deltas.append(d)
        except RequestFailed as exc:
            return self.error(P.ApiError(500, f"generation failed: {exc}", type="server_error",
                                          code="request_failed"))
        finally:
            watcher.cancel()
            if not handle.done:
                self.engine.abort(handle.id)
        result = handle.result(0)
        fmt = P.LogprobFormatter(self.engine.tokenizer, p.kind, p.top_logprobs) if p.logprobs else None
        lp = fmt.block(fmt.entries(deltas)) if fmt is not None else None
        n_out = result.metrics.output_tokens if result.metrics else len(result.token_ids)
        body = P.completion_body(rid, self.model, created, p.kind, result.text, result.finish_reason, lp,
                                 P.usage(_prompt_tokens(result, n_prompt), n_out,
                                         result.metrics.cached_tokens if result.metrics else 0),
                                 token_ids=result.token_ids if p.return_token_ids else None)
        return JSONResponse(self._with_metrics(body, result))

    def _with_metrics(self, body: dict, result) -> dict:
        """--enable-per-request-metrics: the request record's figures as the body's `metrics`."""
        if self.config.per_request_metrics:
            body["metrics"] = response_metrics(result.metrics)
        return body

    async def _abort_on_disconnect(self, request: Request, handle) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.engine.abort(handle.id)
                return

    # --- checks -------------------------------------------------------------------------
    def check_key(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        # compared as bytes: the header may hold any byte, and compare_digest takes ASCII str only
        if not (given.startswith("Bearer ") and
                hmac.compare_digest(given[7:].strip().encode("latin-1"), key.encode("utf-8"))):
            raise P.ApiError(401, "missing or wrong API key: send the header Authorization: Bearer <key> "
                                  "with the key the server was started with (`api_key`)", type="authentication_error",
                             code="invalid_api_key")

    async def read_json(self, request: Request):
        return await read_body(request, self.config.max_body, self.config.body_timeout)

    def error(self, exc: P.ApiError) -> Response:
        """A refusal in OpenAI's error shape, counted in /metrics."""
        self.metrics.http_rejected.labels(self.model, str(exc.status)).inc()
        # a body left unread (too large, too slow, not JSON) must not be taken for the next request
        headers = {"Connection": "close"} if exc.status in (408, 413, 415) else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _prompt_tokens(result, n_prompt: int) -> int:
    """The prompt tokens the worker computed: a remote serving another model counts its own."""
    return result.metrics.prompt_tokens if result.metrics and result.metrics.prompt_tokens else n_prompt


def _sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"
