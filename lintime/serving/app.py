"""The HTTP front end of ``lintime serve``: an ASGI app (Starlette) over the continuous-batching
:class:`~lintime.serving.Engine`, speaking the subset of OpenAI's API that a causal LM without chat
templates can answer.

* ``POST /v1/completions`` -- one prompt (text or token ids), sampled by the engine; the whole answer
  as one JSON object, or (``"stream": true``) server-sent events: ``data: {chunk}`` per piece of text,
  the finish reason in the last chunk, the usage in a chunk of its own when
  ``stream_options.include_usage`` is set, then ``data: [DONE]``;
* ``GET /v1/models``, ``GET /v1/models/{name}`` -- the one model served;
* ``GET /health`` -- 200 with the engine's counters, 503 once the server is shutting down (no key
  needed, so that a load balancer can probe it).

Every error has OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a body or a
parameter the server cannot use (the engine's own message for a value it refuses), 401 for a missing or
wrong ``Authorization: Bearer KEY`` when a key is set, 404 for another model's name or an unknown path,
413 for a body over ``max_body_bytes``, 503 when the engine's queue is full or the server is shutting
down, 500 when the engine fails on a request.  A client that leaves -- mid-stream or while waiting for a
whole answer -- has its request cancelled, so its batch slot goes to the next one.  docs/serve.md is the
user's guide.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import math
import time
import uuid
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from lintime.utils.checks import is_int
from lintime.serving import EngineClosed, QueueFull, Request

log = logging.getLogger("lintime.serve")

RETRY_AFTER_S = 1  # told to a client turned away with 503: the queue drains at the decoding rate, in seconds

# Parameters of OpenAI's completions API that are accepted only at the value that means "off"
# (so a client that sends its defaults explicitly is served); any other value is refused by name.
_OFF = {
    "n": (1,),
    "best_of": (None, 1),
    "logprobs": (None,),
    "suffix": (None, ""),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
}
_KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream",
          "stream_options", "echo", "user", *_OFF}


class APIError(Exception):
    """An error answered in OpenAI's shape: HTTP ``status``, a one-line ``message``, its ``type``,
    the ``param`` at fault (or None) and a machine-readable ``code`` (or None)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _busy() -> APIError:
    return APIError(503, "server busy: the request queue is full; retry later", type="server_error",
                    code="server_busy", headers={"Retry-After": str(RETRY_AFTER_S)})


def _closing() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")


# --- the request body ----------------------------------------------------------------------------

async def _read_json(request: HTTPRequest, limit: int) -> dict:
    """The body as a JSON object; 413 past ``limit`` bytes (by Content-Length before reading, then
    by what arrives, for a chunked body or a wrong length)."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise APIError(400, f"bad Content-Length header {length!r}")
        if int(length) > limit:
            raise _too_large(int(length), limit)
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise _too_large(None, limit)
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        raise APIError(400, f"the request body is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def _too_large(size: int | None, limit: int) -> APIError:
    got = f"{size:,} bytes" if size is not None else "more"
    return APIError(413, f"request body too large: {got}, at most {limit:,} bytes", code="request_too_large")


def _number(data: dict, name: str, default: float) -> float:
    x = data.get(name)
    if x is None:
        return default
    if not (is_int(x) or isinstance(x, float)) or not math.isfinite(x):
        raise APIError(400, f"{name} must be a finite number, got {x!r}", param=name)
    return float(x)


def _integer(data: dict, name: str, default: int | None) -> int | None:
    x = data.get(name)
    if x is None:
        return default
    if not is_int(x):
        raise APIError(400, f"{name} must be an integer, got {x!r}", param=name)
    return x


def _boolean(data: dict, name: str) -> bool:
    x = data.get(name)
    if x is None:
        return False
    if not isinstance(x, bool):
        raise APIError(400, f"{name} must be true or false, got {x!r}", param=name)
    return x


def _prompt(x: Any) -> str | list[int]:
    """OpenAI's prompt forms, one prompt each: a string, a list of one string, a list of token ids,
    or a list of one list of token ids."""
    if isinstance(x, str):
        return x
    if isinstance(x, list) and x and all(is_int(t) for t in x):
        return list(x)
    if isinstance(x, list) and x and all(isinstance(p, (str, list)) for p in x):
        if len(x) > 1:
            raise APIError(400, f"one prompt per request, got {len(x)}: send each as its own request", param="prompt")
        return _prompt(x[0])
    if x is None:
        raise APIError(400, "prompt is required", param="prompt")
    raise APIError(400, "prompt must be a string, a list of one string or a list of token ids", param="prompt")


def _stop(x: Any) -> list[str]:
    if x is None:
        return []
    if isinstance(x, str):
        return [x]
    if isinstance(x, list) and all(isinstance(s, str) for s in x):
        return list(x)
    raise APIError(400, "stop must be a string or a list of strings", param="stop")


def parse_completion(data: dict) -> tuple[Request, bool, bool]:
    """The engine's :class:`Request` for an OpenAI completions body, whether to stream, and whether
    to send the usage in a stream; :class:`APIError` (400) for what cannot be served."""
    unknown = sorted(set(data) - _KNOWN)
    if unknown:
        raise APIError(400, f"unrecognized request argument: {unknown[0]}", param=unknown[0])
    for name, off in _OFF.items():
        if name in data and data[name] not in off:
            allowed = " or ".join("null" if v is None else json.dumps(v) for v in off)
            raise APIError(400, f"{name}={json.dumps(data[name])} is not supported here (only {allowed})", param=name)
    stream = _boolean(data, "stream")
    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", param="stream_options")
    include_usage = bool(stream and options and _boolean(options, "include_usage"))
    request = Request(
        prompt=_prompt(data.get("prompt")),
        max_tokens=_integer(data, "max_tokens", 16),
        temperature=_number(data, "temperature", 1.0),
        top_p=_number(data, "top_p", 1.0),
        top_k=_integer(data, "top_k", 0),
        stop=_stop(data.get("stop")),
        seed=_integer(data, "seed", None),
        echo=_boolean(data, "echo"),
    )
    return request, stream, include_usage


# --- the app -------------------------------------------------------------------------------------

def build_app(engine, *, model_name: str, api_key: str | None = None, max_body_bytes: int = 1_000_000) -> Starlette:
    """The ASGI app serving ``engine`` (started by the caller) as model ``model_name``.  ``api_key``:
    when set, every ``/v1`` request must carry ``Authorization: Bearer <api_key>`` (``/health`` is
    open).  ``max_body_bytes``: the largest request body read."""
    if not model_name:
        raise ValueError("model_name must not be empty")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    created = int(time.time())
    model_card = {"id": model_name, "object": "model", "created": created, "owned_by": "lintime"}

    def authorize(request: HTTPRequest) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken does not tell how much of a guessed key was right
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def check_model(name: Any) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist here: this server serves {model_name!r}",
                           param="model", code="model_not_found")

    async def completions(request: HTTPRequest) -> Response:
        authorize(request)
        try:
            data = await _read_json(request, max_body_bytes)
        except ClientDisconnect:  # the client left while sending: nobody to answer
            return Response(status_code=400)
        check_model(data.get("model"))
        req, stream, include_usage = parse_completion(data)
        if request.app.state.closing:
            raise _closing()
        try:
            handle = engine.submit(req)
        except ValueError as err:
            raise APIError(400, str(err)) from None
        except QueueFull:
            raise _busy() from None
        except EngineClosed:
            raise _closing() from None
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}
        if stream:
            return _EventStream(handle, head, include_usage)
        return await _whole(handle, head, request.receive)

    async def models(request: HTTPRequest) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [model_card]})

    async def model(request: HTTPRequest) -> Response:
        authorize(request)
        check_model(request.path_params["name"])
        return JSONResponse(model_card)

    async def health(request: HTTPRequest) -> Response:
        stats = engine.stats()
        if request.app.state.closing:
            return JSONResponse({"status": "shutting down", **stats}, status_code=503)
        return JSONResponse({"status": "ok", **stats})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        app.state.closing = True

    async def api_error(request: HTTPRequest, err: APIError) -> Response:
        return err.response()

    async def http_error(request: HTTPRequest, err: HTTPException) -> Response:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        message = f"{request.method} {request.url.path}: {err.detail}"
        return APIError(err.status_code, message, code=kind, headers=err.headers).response()

    async def server_error(request: HTTPRequest, err: Exception) -> Response:
        log.error("internal error on %s %s: %r", request.method, request.url.path, err)
        return APIError(500, f"internal server error: {type(err).__name__}: {err}", type="server_error").response()

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        APIError: api_error, HTTPException: http_error, Exception: server_error})
    # True once the server is shutting down (the lifespan's end, or earlier from the server's signal
    # handler): /health answers 503 and new completions are refused
    app.state.closing = False
    return app


# --- answers -------------------------------------------------------------------------------------

def _engine_failure(finish_reason: str | None, error: str | None) -> APIError | None:
    """The error a request that ended with ``finish_reason`` answers with (None: it completed)."""
    if finish_reason == "error":
        return APIError(500, f"the engine failed on this request: {error or 'no detail'}", type="server_error",
                        code="engine_error")
    if finish_reason == "cancelled":  # not by its client (that one is gone): the engine is shutting down
        return _closing()
    if finish_reason not in ("stop", "length"):
        return APIError(500, f"the engine ended the request with finish reason {finish_reason!r}",
                        type="server_error", code="engine_error")
    return None


def _usage(ev) -> dict:
    p, c = ev.prompt_tokens or 0, ev.completion_tokens or 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def _close(events) -> None:
    """Finalise the engine's event iterator now (it may be suspended mid-iteration), whatever
    cancellation is under way."""
    close = getattr(events, "aclose", None)
    if close is not None:
        with anyio.CancelScope(shield=True):
            await close()


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _whole(handle, head: dict, receive) -> Response:
    """Collect a request's events into one completion object; the request is cancelled if the
    client disconnects first (or the handler is cancelled)."""
    parts: list[str] = []
    last = None
    gone = False
    broke: Exception | None = None
    events = handle.events()
    try:
        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                nonlocal gone
                await _until_disconnect(receive)
                gone = True
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:  # caught here, not around the task group (which would wrap it in an ExceptionGroup)
                async for ev in events:
                    parts.append(ev.text or "")
                    last = ev
                    if ev.finish_reason is not None:
                        break
            except Exception as err:
                broke = err
            tg.cancel_scope.cancel()
    finally:
        if last is None or last.finish_reason is None:
            handle.cancel()
        await _close(events)
    if gone:
        return Response(status_code=499)  # nobody reads it; 499 is what the access log shows
    if broke is not None:
        log.error("engine error: %r", broke)
        raise APIError(500, f"internal server error: {type(broke).__name__}: {broke}", type="server_error")
    if last is None or last.finish_reason is None:
        raise APIError(500, "the engine ended the request without a finish reason", type="server_error",
                       code="engine_error")
    failure = _engine_failure(last.finish_reason, last.error)
    if failure is not None:
        raise failure
    choice = {"index": 0, "text": "".join(parts), "finish_reason": last.finish_reason, "logprobs": None}
    return JSONResponse({**head, "choices": [choice], "usage": _usage(last)})


def _sse(obj: Any) -> bytes:
    text = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


class _EventStream:
    """The ``text/event-stream`` answer of a streamed completion (an ASGI app).  The request is
    cancelled when the client disconnects (the ASGI disconnect message, or a send that fails) and
    whenever the stream ends before the engine finished it."""

    headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]  # a proxy in front (nginx) must not buffer the events

    def __init__(self, handle, head: dict, include_usage: bool):
        self.handle, self.head, self.include_usage = handle, head, include_usage
        self.finished = False

    def chunk(self, text: str, finish_reason: str | None) -> dict:
        out = {**self.head, "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}]}
        if self.include_usage:
            out["usage"] = None
        return out

    async def __call__(self, scope, receive, send) -> None:
        events = self.handle.events()
        try:
            async with anyio.create_task_group() as tg:
                async def watch() -> None:
                    await _until_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                try:
                    await self.stream(events, send)
                except OSError:  # the client went away: a send failed
                    pass
                tg.cancel_scope.cancel()
        finally:
            if not self.finished:
                self.handle.cancel()
            await _close(events)

    async def stream(self, events, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})

        async def put(obj) -> None:
            await send({"type": "http.response.body", "body": _sse(obj), "more_body": True})

        try:
            async for ev in events:
                if ev.finish_reason is None:
                    if ev.text:
                        await put(self.chunk(ev.text, None))
                    continue
                self.finished = True
                failure = _engine_failure(ev.finish_reason, ev.error)
                if failure is not None:
                    await put(failure.body())
                else:
                    await put(self.chunk(ev.text or "", ev.finish_reason))
                    if self.include_usage:
                        await put({**self.head, "choices": [], "usage": _usage(ev)})
                break
            else:
                await put(APIError(500, "the engine ended the request without a finish reason",
                                   type="server_error", code="engine_error").body())
        except OSError:  # the client is gone: nothing more to send
            raise
        except Exception as err:  # the engine broke mid-stream: the status line is gone, so say it in the stream
            log.error("engine error while streaming: %r", err)
            await put(APIError(500, f"internal server error: {type(err).__name__}: {err}", type="server_error").body())
        await put("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})
