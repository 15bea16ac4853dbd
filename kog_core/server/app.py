"""`kog serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over one Engine.

    GET  /health                 liveness (never needs the API key)
    GET  /metrics                Prometheus text format
    GET  /v1/models              the served model, with its context length
    POST /v1/completions         text / token-id prompt, streaming or not
    POST /v1/chat/completions    chat messages (the model's chat template), streaming or not

See docs/serving.md. The engine runs in one worker thread (scheduler.py); requests wait in a
bounded FIFO queue and past it get 429 with Retry-After."""
import asyncio
import contextlib
import hmac
import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Optional

from pydantic import ValidationError

from ..errors import KogError
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, Metrics
from .scheduler import END, Job, QueueFull, Scheduler
from .schemas import ChatCompletionRequest, CompletionRequest, UnsupportedParameter

log = logging.getLogger("kog.server")

DISCONNECT_POLL_S = 0.2


# ----------------------------------------------------------------------------- errors

class APIError(Exception):
    """An OpenAI-shaped error: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _error_body(status: int, message: str, type: str, code: str | None = None, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": param, "code": code}}).encode()


_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}  # pydantic's union-member loc parts


def _validation_error(e: ValidationError) -> APIError:
    problems, first_param = [], None
    for err in e.errors():
        loc = [str(p) for p in err.get("loc", ()) if str(p) not in _UNION_TAGS and "[" not in str(p)]
        param = ".".join(loc) if loc else None
        first_param = first_param or (loc[0] if loc else None)
        msg = err.get("msg", "invalid value")
        if err.get("type") == "missing":
            msg = "this field is required"
        problems.append(f"{param}: {msg}" if param else msg)
    seen = list(dict.fromkeys(problems))
    return APIError(400, "invalid request: " + "; ".join(seen[:5]), param=first_param,
                    code="invalid_value" if first_param else None)


# ----------------------------------------------------------------------------- ASGI guard

_ROUTES = {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"}

class Guard:
    """Pure ASGI middleware, outermost: API key (every route but /health) and request body size.

    Bodies are read here (up to max_body_bytes, else 413) and replayed to the app; later
    `receive` calls go to the server, so disconnects are still seen."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics: Metrics):
        self.app, self.api_key, self.max_body, self.metrics = app, api_key, max_body_bytes, metrics

    async def _reply(self, send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = ()):
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *headers]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        label = path if path in _ROUTES else "other"   # bounded metric label values
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key and path != "/health":
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                self.metrics.count_request(label, 401)
                msg = ("Incorrect API key provided." if auth else
                       "Missing API key: send the header 'Authorization: Bearer <key>'.")
                return await self._reply(send, 401, _error_body(401, msg, "invalid_request_error", "invalid_api_key"),
                                         [(b"www-authenticate", b"Bearer")])
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_big = _error_body(413, f"the request body is larger than {self.max_body} bytes", "invalid_request_error",
                              "request_too_large")
        try:
            if int(headers.get("content-length", "0")) > self.max_body:
                self.metrics.count_request(label, 413)
                return await self._reply(send, 413, too_big, [(b"connection", b"close")])
        except ValueError:
            return await self._reply(send, 400, _error_body(400, "invalid Content-Length", "invalid_request_error"))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body:
                self.metrics.count_request(label, 413)
                return await self._reply(send, 413, too_big, [(b"connection", b"close")])
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay_receive():
            return replay.pop() if replay else await receive()

        await self.app(scope, replay_receive, send)


# ----------------------------------------------------------------------------- the app

def _default_model_name(engine) -> str:
    name = engine.config.model.name or "kog"
    if os.sep in name or "/" in name and Path(name).exists() or name.endswith((".gguf", ".safetensors")):
        p = Path(name)
        return p.stem if p.suffix in (".gguf", ".safetensors") else p.name
    return name


def create_app(engine, server_config=None):
    """A FastAPI app serving `engine`. server_config: kog_core.config.ServerSection (default: the
    engine config's [server] section)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    sc = server_config if server_config is not None else engine.config.server
    model_name = sc.served_model_name or _default_model_name(engine)
    aliases = {model_name, engine.config.model.name or model_name}
    ctx = engine.program.context_length
    engine.prefix_reuse = engine.prefix_reuse and sc.prefix_reuse  # off: no TTFT tells one client of another's prompt
    metrics = Metrics(model_name)
    scheduler = Scheduler(engine, sc.queue_size, metrics)
    created = int(time.time())

    async def stats_loop():
        last = metrics.snapshot()
        t_last = time.perf_counter()
        while True:
            await asyncio.sleep(sc.stats_interval_s)
            now, snap = time.perf_counter(), metrics.snapshot()
            gen = snap["generation_tokens"] - last["generation_tokens"]
            log.info("stats: %d requests (%d completed, %d rejected), running %d, waiting %d; tokens in %d, out %d; "
                     "%.1f tok/s generated over the last %.0fs", snap["requests"], snap["completed"], snap["rejected"],
                     snap["running"], snap["waiting"], snap["prompt_tokens"], snap["generation_tokens"],
                     gen / max(now - t_last, 1e-9), now - t_last)
            last, t_last = snap, now

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        task = asyncio.create_task(stats_loop())
        log.info("serving %s (context %d tokens, backend %s) - queue size %d%s", model_name, ctx,
                 getattr(engine.backend, "name", "?"), sc.queue_size, ", API key required" if sc.api_key else "")
        try:
            yield
        finally:
            task.cancel()
            await asyncio.to_thread(scheduler.close)

    app = FastAPI(title="kog", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine, app.state.scheduler, app.state.metrics, app.state.model_name = engine, scheduler, metrics, model_name

    # ------------------------------------------------------------------ error handlers
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError):
        return JSONResponse({"error": {"message": f"invalid request: {exc.errors()[:3]}", "type": "invalid_request_error",
                                       "param": None, "code": None}}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse({"error": {"message": f"{exc.detail}: {request.method} {request.url.path}", "type": kind,
                                       "param": None, "code": None}}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse({"error": {"message": f"internal server error: {type(exc).__name__}", "type": "server_error",
                                       "param": None, "code": None}}, status_code=500)

    # ------------------------------------------------------------------ helpers
    async def parse(request: Request, model_cls):
        body = await request.body()
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json")
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            req = model_cls.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e)
        if req.model is not None and req.model not in aliases:
            raise APIError(404, f"The model `{req.model}` does not exist; this server serves `{model_name}` "
                                f"(see GET /v1/models).", param="model", code="model_not_found")
        try:
            req.check_supported()
        except UnsupportedParameter as e:
            raise APIError(400, str(e), param=e.param, code="unsupported_parameter")
        if req.ignored_params():
            log.debug("ignoring unknown parameters %s", req.ignored_params())
        return req

    async def encode(prompt, chat: bool, param: str) -> list[int]:
        try:
            ids = await asyncio.to_thread(engine.encode_prompt, prompt, chat)
        except KogError as e:
            raise APIError(400, str(e), param=param)
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        if len(ids) >= ctx:
            what = "messages" if chat else "prompt"
            raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, your {what} resulted "
                                f"in {len(ids)} tokens (and at least 1 more must be generated). Please reduce the "
                                f"length of the {what}.", param=param, code="context_length_exceeded")
        return ids

    def engine_params(req, limit: Optional[int], n_prompt: int) -> dict[str, Any]:
        temperature, top_p = req.temperature, req.top_p
        if top_p == 0.0:       # OpenAI accepts top_p=0: the single most likely token, i.e. greedy
            temperature, top_p = 0.0, None
        return dict(max_tokens=limit if limit is not None else ctx - n_prompt,  # engine clamps to the context
                    temperature=temperature, top_p=top_p, top_k=req.top_k, seed=req.seed, stop=req.stop,
                    ignore_eos=req.ignore_eos)

    def submit(endpoint: str, prefix: str, ids: list[int], params: dict) -> Job:
        job = Job(id=f"{prefix}-{uuid.uuid4().hex[:24]}", endpoint=endpoint, prompt_ids=ids, params=params,
                  loop=asyncio.get_running_loop())
        try:
            scheduler.submit(job)
        except QueueFull as e:
            metrics.count_request(endpoint, 429)
            waiting, running = scheduler.depth()
            raise APIError(429, f"The server is busy ({running} running, {waiting} waiting); retry after "
                                f"{e.retry_after}s.", type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(e.retry_after)})
        return job

    async def items(job: Job, request: Request, poll: bool) -> AsyncIterator[Any]:
        """The job's chunks (or an exception) until END; with poll, checks for a client disconnect."""
        last_check = time.monotonic()
        while True:
            try:
                item = await asyncio.wait_for(job.queue.get(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                item = None
            if item is END:
                return
            if item is not None:
                yield item
            if poll and time.monotonic() - last_check >= DISCONNECT_POLL_S:
                last_check = time.monotonic()
                if await request.is_disconnected():
                    raise ConnectionAbortedError("client disconnected")

    def usage(result) -> dict:
        return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                "total_tokens": result.prompt_tokens + result.completion_tokens,
                # OpenAI's field: prompt tokens served from the KV cache the previous request left
                "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}

    def error_from(exc: Exception) -> APIError:
        if isinstance(exc, KogError):
            return APIError(400, str(exc))
        return APIError(500, f"generation failed: {type(exc).__name__}", type="server_error")

    async def run(request: Request, job: Job, endpoint: str, chat: bool, stream: bool, include_usage: bool):
        obj = "chat.completion" if chat else "text_completion"
        t_created = int(time.time())
        base = {"id": job.id, "object": obj + (".chunk" if chat and stream else ""), "created": t_created,
                "model": model_name, "system_fingerprint": None}
        headers = {"X-Request-Id": job.id}

        if not stream:
            result, done = None, False
            try:
                async for item in items(job, request, poll=True):
                    if isinstance(item, Exception):
                        metrics.count_request(endpoint, 400 if isinstance(item, KogError) else 500)
                        raise error_from(item)
                    result = item.result or result
                done = True
            except ConnectionAbortedError:
                metrics.count_request(endpoint, 499)
                return Response(status_code=499)
            finally:
                if not done:
                    scheduler.cancel(job)
            if result is None:
                metrics.count_request(endpoint, 503)
                raise APIError(503, "the server is shutting down", type="server_error")
            metrics.count_request(endpoint, 200)
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": result.text, "refusal": None},
                          "logprobs": None, "finish_reason": result.finish_reason}
            else:
                choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}
            return JSONResponse({**base, "choices": [choice], "usage": usage(result)}, headers=headers)

        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        def chunk(text: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            payload = {**base, "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            return event(payload)

        poll = tuple(map(int, request.scope.get("asgi", {}).get("spec_version", "2.0").split("."))) >= (2, 4)

        async def events():
            sent, done = "", False
            try:
                if chat:
                    yield chunk(None, None, role=True)
                async for item in items(job, request, poll=poll):
                    if isinstance(item, Exception):
                        err = error_from(item)
                        yield event(err.body())
                        break
                    if item.text:
                        sent += item.text
                        yield chunk(item.text, None)
                    if item.result is not None:
                        res = item.result
                        # safety net: the engine flushes held-back text on every finish, so the
                        # streamed text should already equal the final text; send any difference
                        if res.text.startswith(sent) and len(res.text) > len(sent):
                            yield chunk(res.text[len(sent):], None)
                        yield chunk(None, res.finish_reason)
                        if include_usage:
                            yield event({**base, "choices": [], "usage": usage(res)})
                yield "data: [DONE]\n\n"
                done = True
            finally:
                if not done:
                    scheduler.cancel(job)

        metrics.count_request(endpoint, 200)
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health():
        waiting, running = scheduler.depth()
        return {"status": "ok", "model": model_name, "running": running, "waiting": waiting}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "kog",
                "context_length": ctx, "max_model_len": ctx}

    @app.get("/v1/models")
    async def list_models():
        metrics.count_request("/v1/models", 200)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id not in aliases:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return model_card()

    async def complete(request: Request, endpoint: str, schema, chat: bool):
        """Parse, check and queue one request of either endpoint, then answer it (streamed or not).
        Errors before queueing count in the metrics here; a 429 is counted by the queue."""
        try:
            req = await parse(request, schema)
            try:
                content = req.chat_messages() if chat else req.single_prompt()
            except UnsupportedParameter as e:
                raise APIError(400, str(e), param=e.param, code="unsupported_parameter")
            ids = await encode(content, chat, "messages" if chat else "prompt")
            limit = req.limit if chat else req.max_tokens
            job = submit(endpoint, "chatcmpl" if chat else "cmpl", ids, engine_params(req, limit, len(ids)))
        except APIError as e:
            if e.status != 429:
                metrics.count_request(endpoint, e.status)
            raise
        return await run(request, job, endpoint, chat, bool(req.stream), req.include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, "/v1/chat/completions", ChatCompletionRequest, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, "/v1/completions", CompletionRequest, chat=False)

    app.add_middleware(Guard, api_key=sc.api_key, max_body_bytes=sc.max_body_bytes, metrics=metrics)
    return app


# ----------------------------------------------------------------------------- kog serve

def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise KogError(f"cannot listen on {host}:{port}: unknown host ({e.strerror}); pass --host 127.0.0.1 "
                       f"or 0.0.0.0")
    family, socktype, proto, _, addr = infos[0]
    sock = socket.socket(family, socktype, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        why = "the port is already in use; pass another --port" if e.errno == 98 or "in use" in str(e) else e.strerror
        raise KogError(f"cannot listen on {host}:{port}: {why}")
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _setup_logging():
    logger = logging.getLogger("kog")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def serve(args) -> None:
    """`kog serve`: load the model and serve it until interrupted."""
    from ..config import load_config
    from ..engine import Engine
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise KogError(f"kog serve needs FastAPI and uvicorn ({e.name} is missing); pip install 'kog[serve]'")
    g = lambda name: getattr(args, name, None)  # noqa: E731
    overrides = {"model": {"name": g("model"), "random_weights": g("random_weights") or None,
                           "context_length": g("context_length")},
                 "backend": {"name": g("backend")},
                 "parallel": {"ranks": g("ranks")},
                 "server": {"host": g("host"), "port": g("port"),
                            "api_key": g("api_key") or os.environ.get("KOG_API_KEY") or None,
                            "served_model_name": g("served_model_name")}}
    cfg = load_config(g("config"), overrides)
    sc = cfg.server
    sock = _bind(sc.host, sc.port)  # fail fast, before the model loads
    _setup_logging()
    try:
        engine = Engine.from_config(cfg, progress=True)
        app = create_app(engine, sc)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        log.info("listening on http://%s:%d/v1 (OpenAI-compatible)", shown, port)
        config = uvicorn.Config(app, log_level="info", access_log=False, timeout_graceful_shutdown=3,
                                limit_concurrency=None)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
