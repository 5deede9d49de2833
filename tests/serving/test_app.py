"""The HTTP layer of ``lintime serve`` (lintime/serving/app.py) over a scripted engine: every endpoint,
every error status in OpenAI's shape, the server-sent-event framing, the API key, the body limit, and a
client that leaves (its request is cancelled).  The real engine behind a real server:
tests/serving/test_server.py."""

from __future__ import annotations

import json

import anyio
import openai
import pytest
from starlette.testclient import TestClient

from lintime.serving import EngineClosed, Event, Handle, QueueFull
from lintime.serving.app import build_app

MODEL = "tiny"
KEY = "sk-test-0123456789"


class FakeEngine:
    """The engine's API with scripted answers: the completion of a request is ``max_tokens`` pieces
    ``"w0 "``, ``"w1 "``, ... (finish ``"length"``), published at ``submit``; a prompt names another
    script: ``"stop"`` (two pieces, then ``"stop"``), ``"hang"`` (one piece, then nothing until cancelled),
    ``"fail"`` (an engine error), ``"crash"`` (the event iterator raises).  ``raise_on_submit``: the
    exception ``submit`` raises instead."""

    def __init__(self):
        self.requests, self.handles = [], []
        self.cancelled: list[int] = []
        self.raise_on_submit: Exception | None = None

    def submit(self, request):
        if self.raise_on_submit is not None:
            raise self.raise_on_submit
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer in [1, 4096], got {request.max_tokens}")
        self.requests.append(request)
        cls = _CrashingHandle if request.prompt == "crash" else Handle
        handle = cls(request, len(self.handles), self._cancel)
        self.handles.append(handle)
        prompt_tokens = len(request.prompt) + 1
        echo = request.prompt if request.echo and isinstance(request.prompt, str) else ""
        if request.prompt == "fail":
            handle._publish(Event("", [], "error", prompt_tokens, 0, error="CUDA out of memory"))
            return handle
        script = request.prompt if isinstance(request.prompt, str) else ""
        pieces = {"stop": 2, "hang": 1}.get(script, request.max_tokens)
        for i in range(pieces):
            last = i == pieces - 1 and request.prompt != "hang"
            reason = ("stop" if request.prompt == "stop" else "length") if last else None
            handle._publish(Event((echo if i == 0 else "") + f"w{i} ", [i], reason, prompt_tokens, i + 1))
        return handle

    def _cancel(self, handle):
        self.cancelled.append(handle.id)
        ev = handle._events[-1] if handle._events else None
        handle._publish(Event("", [], "cancelled", ev.prompt_tokens if ev else 0, ev.completion_tokens if ev else 0))

    def stats(self):
        return {"running": 0, "waiting": 0, "max_batch": 4}


class _CrashingHandle(Handle):
    async def events(self):
        yield Event("w0 ", [0], None, 2, 1)
        raise RuntimeError("the loop thread died")


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture
def client(engine):
    with TestClient(build_app(engine, model_name=MODEL), raise_server_exceptions=False) as c:
        yield c


def _error(res, status: int, *, param=None, code=None) -> str:
    assert res.status_code == status, res.text
    err = res.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and "\n" not in err["message"]
    assert err["param"] == param and (code is None or err["code"] == code), err
    return err["message"]


def _events(res) -> list:
    """The ``data:`` payloads of an event stream, checking the framing: every event is one ``data:``
    line followed by a blank line, and the last one is ``[DONE]``."""
    assert res.status_code == 200, res.text
    assert res.headers["content-type"].startswith("text/event-stream")
    blocks = res.text.split("\n\n")
    assert blocks[-1] == "", "the stream must end with a blank line"
    out = []
    for block in blocks[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block
        out.append(block[len("data: "):])
    assert out[-1] == "[DONE]" and "[DONE]" not in out[:-1]
    return [json.loads(x) for x in out[:-1]]


# --- completions ---------------------------------------------------------------------------------

def test_a_completion_has_openais_shape(client, engine):
    res = client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 3, "temperature": 0,
                                               "top_p": 0.9, "top_k": 5, "stop": "\n", "seed": 7, "user": "u1"})
    assert res.status_code == 200, res.text
    body = res.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
    assert isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": "w0 w1 w2 ", "finish_reason": "length", "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    req = engine.requests[0]
    assert (req.prompt, req.max_tokens, req.temperature, req.top_p, req.top_k, list(req.stop), req.seed, req.echo) == \
        ("abc", 3, 0.0, 0.9, 5, ["\n"], 7, False)


def test_defaults_follow_openai(client, engine):
    res = client.post("/v1/completions", json={"prompt": "abc"})  # no model: the one served
    assert res.status_code == 200 and res.json()["usage"]["completion_tokens"] == 16
    req = engine.requests[0]
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, list(req.stop), req.seed) == (16, 1.0, 1.0, 0, [], None)


def test_the_defaults_of_unsupported_parameters_are_accepted(client, engine):
    off = {"n": 1, "best_of": 1, "logprobs": None, "suffix": None, "presence_penalty": 0, "frequency_penalty": 0.0,
           "logit_bias": {}, "stream": False, "stream_options": None, "echo": False, "max_tokens": None}
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x", **off}).status_code == 200


@pytest.mark.parametrize("prompt, sent", [(["abc"], "abc"), ([5, 6, 7], [5, 6, 7]), ([[5, 6]], [5, 6])])
def test_prompt_forms(client, engine, prompt, sent):
    assert client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code == 200
    assert engine.requests[0].prompt == sent


def test_stop_as_a_list_and_echo(client, engine):
    res = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "stop": ["x", "y"], "echo": True})
    assert res.json()["choices"][0]["text"] == "abcw0 w1 "
    assert list(engine.requests[0].stop) == ["x", "y"] and engine.requests[0].echo is True


def test_a_stop_finish(client):
    choice = client.post("/v1/completions", json={"prompt": "stop"}).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("w0 w1 ", "stop")


# --- streams -------------------------------------------------------------------------------------

def test_a_stream_sends_each_piece_then_the_finish_then_done(client):
    res = client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 3, "stream": True})
    chunks = _events(res)
    assert [c["choices"][0]["text"] for c in chunks] == ["w0 ", "w1 ", "w2 "]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    for c in chunks:
        assert c["object"] == "text_completion" and c["model"] == MODEL and "usage" not in c
        assert c["choices"][0]["index"] == 0 and c["choices"][0]["logprobs"] is None
    assert res.headers["cache-control"] == "no-cache"


def test_a_stream_with_usage_ends_with_a_usage_chunk(client):
    res = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "stream": True,
                                               "stream_options": {"include_usage": True}})
    chunks = _events(res)
    assert [c["usage"] for c in chunks[:-1]] == [None, None]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 2,
                                                                   "total_tokens": 6}


def test_a_streamed_text_equals_the_whole_one(client):
    body = {"prompt": "abc", "max_tokens": 5, "echo": True}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    chunks = _events(client.post("/v1/completions", json={**body, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole


def test_an_engine_error_mid_stream_is_an_error_event(client):
    chunks = _events(client.post("/v1/completions", json={"prompt": "fail", "stream": True}))
    assert chunks == [{"error": {"message": "the engine failed on this request: CUDA out of memory",
                                 "type": "server_error", "param": None, "code": "engine_error"}}]


def test_an_engine_crash_mid_stream_is_an_error_event(client):
    chunks = _events(client.post("/v1/completions", json={"prompt": "crash", "stream": True}))
    assert chunks[0]["choices"][0]["text"] == "w0 "
    assert "the loop thread died" in chunks[1]["error"]["message"] and chunks[1]["error"]["type"] == "server_error"


# --- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({}, "prompt"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "a", "n": 2}, "n"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "logprobs": 1}, "logprobs"),
    ({"prompt": "a", "logprobs": 0}, "logprobs"),
    ({"prompt": "a", "suffix": "end"}, "suffix"),
    ({"prompt": "a", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "a", "logit_bias": {"5": 1}}, "logit_bias"),
    ({"prompt": "a", "functions": []}, "functions"),
    ({"prompt": "a", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "top_k": 2.5}, "top_k"),
    ({"prompt": "a", "seed": "s"}, "seed"),
    ({"prompt": "a", "stop": 5}, "stop"),
    ({"prompt": "a", "stop": ["a", 1]}, "stop"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "echo": 1}, "echo"),
    ({"prompt": "a", "stream": True, "stream_options": []}, "stream_options"),
    ({"prompt": "a", "stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage"),
])
def test_a_parameter_that_cannot_be_served_is_400_naming_it(client, engine, body, param):
    _error(client.post("/v1/completions", json=body), 400, param=param)
    assert engine.requests == []


def test_a_non_finite_number_is_400(client):
    res = client.post("/v1/completions", content=b'{"prompt": "a", "temperature": NaN}')
    assert "finite" in _error(res, 400, param="temperature")


def test_the_engines_refusal_is_400_with_its_message(client):
    res = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 0})
    assert _error(res, 400) == "max_tokens must be an integer in [1, 4096], got 0"


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_a_body_that_is_not_a_json_object_is_400(client, content):
    _error(client.post("/v1/completions", content=content), 400)


def test_another_models_name_is_404(client):
    msg = _error(client.post("/v1/completions", json={"model": "gpt-4", "prompt": "a"}), 404, param="model",
                 code="model_not_found")
    assert "gpt-4" in msg and MODEL in msg


def test_an_unknown_path_or_method_has_openais_shape(client):
    _error(client.get("/v1/chat/completions"), 404, code="not_found")
    _error(client.get("/v1/completions"), 405, code="method_not_allowed")


def test_a_body_over_the_limit_is_413_by_its_length_or_by_what_arrives(engine):
    app = build_app(engine, model_name=MODEL, max_body_bytes=100)
    with TestClient(app) as c:
        big = json.dumps({"prompt": "x" * 200}).encode()
        _error(c.post("/v1/completions", content=big), 413, code="request_too_large")
        # no Content-Length (chunked): the limit applies to what is read
        _error(c.post("/v1/completions", content=iter([big[:60], big[60:]])), 413, code="request_too_large")
        assert c.post("/v1/completions", json={"prompt": "x" * 50, "max_tokens": 1}).status_code == 200
    assert len(engine.requests) == 1


def test_a_full_queue_is_503_server_busy(client, engine):
    engine.raise_on_submit = QueueFull("256 requests are already waiting or running")
    res = client.post("/v1/completions", json={"prompt": "a"})
    assert "busy" in _error(res, 503, code="server_busy")
    assert res.headers["retry-after"] == "1"


def test_a_closed_engine_is_503(client, engine):
    engine.raise_on_submit = EngineClosed("shut down")
    assert "shutting down" in _error(client.post("/v1/completions", json={"prompt": "a"}), 503, code="shutting_down")


def test_an_engine_error_is_500_and_the_server_stays_up(client):
    msg = _error(client.post("/v1/completions", json={"prompt": "fail"}), 500, code="engine_error")
    assert msg == "the engine failed on this request: CUDA out of memory"
    assert "the loop thread died" in _error(client.post("/v1/completions", json={"prompt": "crash"}), 500)
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200


# --- API key -------------------------------------------------------------------------------------

@pytest.fixture
def keyed(engine):
    with TestClient(build_app(engine, model_name=MODEL, api_key=KEY)) as c:
        yield c


@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Bearer {KEY}x", f"Basic {KEY}", KEY, "Bearer "])
def test_a_missing_or_wrong_key_is_401(keyed, engine, header):
    headers = {} if header is None else {"Authorization": header}
    for res in (keyed.post("/v1/completions", json={"prompt": "a"}, headers=headers),
                keyed.get("/v1/models", headers=headers), keyed.get(f"/v1/models/{MODEL}", headers=headers)):
        assert "API key" in _error(res, 401, code="invalid_api_key")
    assert engine.requests == []


def test_the_right_key_is_served_and_health_needs_none(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert keyed.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers=auth).status_code == 200
    assert keyed.get("/v1/models", headers={"authorization": f"bearer {KEY}"}).status_code == 200
    assert keyed.get("/health").status_code == 200


def test_the_key_is_checked_before_the_body_is_read(engine):
    with TestClient(build_app(engine, model_name=MODEL, api_key=KEY, max_body_bytes=10)) as c:
        _error(c.post("/v1/completions", content=b"x" * 100), 401)


# --- models, health ------------------------------------------------------------------------------

def test_models_lists_the_one_model(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["object"] == "model" and body["data"][0]["owned_by"] == "lintime"
    assert client.get(f"/v1/models/{MODEL}").json() == body["data"][0]
    _error(client.get("/v1/models/other"), 404, param="model")


def test_health_reports_the_engine_and_503_once_closing(engine):
    app = build_app(engine, model_name=MODEL)
    with TestClient(app) as c:
        res = c.get("/health")
        assert res.status_code == 200 and res.json() == {"status": "ok", "running": 0, "waiting": 0, "max_batch": 4}
        app.state.closing = True  # what the server's stop signal does
        res = c.get("/health")
        assert res.status_code == 503 and res.json()["status"] == "shutting down"
        _error(c.post("/v1/completions", json={"prompt": "a"}), 503, code="shutting_down")
    assert engine.requests == []


def test_the_lifespans_end_marks_the_app_closing(engine):
    app = build_app(engine, model_name=MODEL)
    with TestClient(app):
        assert app.state.closing is False
    assert app.state.closing is True


def test_build_app_checks_its_arguments(engine):
    with pytest.raises(ValueError, match="model_name"):
        build_app(engine, model_name="")
    with pytest.raises(ValueError, match="max_body_bytes"):
        build_app(engine, model_name=MODEL, max_body_bytes=0)


# --- a client that leaves ------------------------------------------------------------------------

async def _call(app, body: dict, *, leave_after_body_messages: int, send_fails: bool = False) -> list[dict]:
    """Call the app as a server would, for a client that disconnects once the app has sent
    ``leave_after_body_messages`` body messages (0: as soon as the request reached the engine), or
    whose first body send fails (``send_fails``).  Returns what the app sent."""
    raw = json.dumps(body).encode()
    sent: list[dict] = []
    gone = anyio.Event()
    inbox = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive():
        if inbox:
            return inbox.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if send_fails and message["type"] == "http.response.body":
            raise OSError("Broken pipe")
        sent.append(message)
        if sum(m["type"] == "http.response.body" for m in sent) >= leave_after_body_messages > 0:
            gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000), "server": ("testserver", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(app, scope, receive, send)
            if leave_after_body_messages == 0 and not send_fails:
                while not app.state.engine.requests:
                    await anyio.sleep(0.01)
                gone.set()
    return sent


def _leaving(engine, **kw) -> list[dict]:
    app = build_app(engine, model_name=MODEL)
    app.state.engine = engine
    return anyio.run(lambda: _call(app, **kw))


@pytest.mark.parametrize("leave", [0, 1])
def test_a_client_that_leaves_a_stream_cancels_its_request(engine, leave):
    sent = _leaving(engine, body={"prompt": "hang", "stream": True}, leave_after_body_messages=leave)
    assert engine.cancelled == [0]
    if leave:
        assert sent[1]["body"].startswith(b"data: {")


def test_a_failed_send_cancels_the_stream(engine):
    _leaving(engine, body={"prompt": "hang", "stream": True}, leave_after_body_messages=0, send_fails=True)
    assert engine.cancelled == [0]


def test_a_client_that_leaves_before_a_whole_answer_cancels_its_request(engine):
    sent = _leaving(engine, body={"prompt": "hang"}, leave_after_body_messages=0)
    assert engine.cancelled == [0]
    assert sent[0]["status"] == 499


def test_a_finished_request_is_not_cancelled(engine):
    _leaving(engine, body={"prompt": "a", "max_tokens": 2, "stream": True}, leave_after_body_messages=10 ** 6,
             send_fails=False)
    assert engine.cancelled == [] and engine.handles[0].finished


# --- the openai client ---------------------------------------------------------------------------

@pytest.fixture
def oai(engine):
    with TestClient(build_app(engine, model_name=MODEL, api_key=KEY)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)


def test_the_openai_client_reads_plain_and_streamed_completions(oai):
    out = oai.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0)
    assert out.choices[0].text == "w0 w1 w2 " and out.choices[0].finish_reason == "length"
    assert out.usage.total_tokens == 7
    chunks = list(oai.completions.create(model=MODEL, prompt="abc", max_tokens=3, stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "w0 w1 w2 "
    assert chunks[-1].usage.completion_tokens == 3
    assert [m.id for m in oai.models.list()] == [MODEL]
    assert oai.models.retrieve(MODEL).id == MODEL


def test_the_openai_client_raises_on_each_error(oai, engine):
    with pytest.raises(openai.AuthenticationError):
        oai.with_options(api_key="wrong").completions.create(model=MODEL, prompt="a")
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4", prompt="a")
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        oai.completions.create(model=MODEL, prompt="a", logprobs=2)
    with pytest.raises(openai.InternalServerError, match="CUDA out of memory"):
        oai.completions.create(model=MODEL, prompt="fail")
    with pytest.raises(openai.APIError, match="CUDA out of memory"):
        list(oai.completions.create(model=MODEL, prompt="fail", stream=True))
    engine.raise_on_submit = QueueFull("full")
    with pytest.raises(openai.InternalServerError) as info:
        oai.completions.create(model=MODEL, prompt="a")
    assert info.value.status_code == 503
