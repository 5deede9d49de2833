"""``lintime serve`` as a user runs it: a real server process on 127.0.0.1 (a free port, ``--port 0``)
over a tiny model, answered by the ``openai`` client -- plain and streamed, 16 clients at once whose
greedy completions equal their single-request ones, a wrong key, a client that leaves, SIGTERM while a
request runs -- and the command's one-line errors.  Every wait is bounded; every server process is
killed in a ``finally``."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from tiny_presets import small_chunks

from lintime.cli import main
from lintime.data import ByteTokenizer
from lintime.models import CausalLM, get_preset
from lintime.training.checkpoint import save_checkpoint, write_run_config

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "LINTIME_API_KEY": ""}
KEY = "sk-lintime-test"
START_S = 120  # most seconds for a server to print its address (imports + loading a tiny model)
REQUEST_S = 60  # most seconds for one request


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run folder with one checkpoint of a gla-tiny model whose weight matrices are scaled up 8x, so that
    its greedy completions differ from prompt to prompt (a fresh tiny model repeats one byte)."""
    run = tmp_path_factory.mktemp("runs") / "tiny"
    tok = ByteTokenizer()
    cfg = small_chunks(get_preset("gla-tiny", vocab_size=tok.vocab_size))
    torch.manual_seed(0)
    model = CausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(8)
    write_run_config(run, model_config=cfg, objective="clm", tokenizer=tok, train={})
    save_checkpoint(run, 0, model, {})
    return run


class Server:
    """A ``lintime serve`` process; its stdout and stderr go to files (a full pipe would stall it)."""

    def __init__(self, run_dir: Path, logs: Path, *flags: str):
        self.out, self.err = logs / "stdout.txt", logs / "stderr.txt"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "lintime", "serve", str(run_dir), "--port", "0",
                                          "--device", "cpu", "--threads", "1", *flags],
                                         stdout=out, stderr=err, env=ENV, cwd=REPO)
        deadline = time.monotonic() + START_S
        while (hit := re.search(r" at (http://\S+/v1) ", self.out.read_text())) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"lintime serve did not start: {self.logs()}")
            time.sleep(0.1)
        self.url = hit.group(1)

    def logs(self) -> str:
        return f"rc={self.proc.poll()}\nstdout:\n{self.out.read_text()}\nstderr:\n{self.err.read_text()}"

    def client(self, key: str = KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=REQUEST_S, **kw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(run_dir, tmp_path_factory):
    srv = Server(run_dir, tmp_path_factory.mktemp("logs"), "--api-key", KEY, "--max-batch", "8", "--name", "tiny")
    try:
        yield srv
    finally:
        srv.stop()


PROMPTS = [f"client {i}: {'xyz'[i % 3] * i}" for i in range(16)]


def _complete(client: openai.OpenAI, prompt: str, stream: bool, max_tokens: int = 12) -> tuple[str, str]:
    if not stream:
        choice = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0]
        return choice.text, choice.finish_reason
    text, finish = [], None
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True):
        text.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def _health(server: Server) -> dict:
    return httpx.get(server.url.removesuffix("/v1") + "/health", timeout=REQUEST_S).json()


def test_the_openai_client_gets_plain_and_streamed_completions(server):
    client = server.client()
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.model == "tiny" and out.id.startswith("cmpl-")
    assert out.usage.prompt_tokens == len(b"hello") + 1 and 1 <= out.usage.completion_tokens <= 12
    streamed = _complete(client, "hello", stream=True)
    assert streamed == (out.choices[0].text, out.choices[0].finish_reason)
    chunks = list(client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert [m.id for m in client.models.list()] == ["tiny"]
    health = _health(server)
    assert health["status"] == "ok" and health["max_batch"] == 8


def test_sixteen_concurrent_clients_get_their_single_request_completions(server):
    client = server.client()
    alone = [_complete(client, p, stream=False) for p in PROMPTS]
    assert len({text for text, _ in alone}) > 8, alone  # the model's answers depend on the prompt
    before = _health(server)
    with ThreadPoolExecutor(16) as pool:  # 16 clients, 8 slots: half wait in the queue
        together = list(pool.map(lambda i: _complete(server.client(), PROMPTS[i], stream=i % 2 == 1), range(16)))
    assert together == alone
    after = _health(server)
    steps, tokens = after["steps"] - before["steps"], after["tokens_generated"] - before["tokens_generated"]
    assert steps < tokens, (steps, tokens)  # the requests were decoded together


def test_a_wrong_key_is_refused_through_the_client(server):
    with pytest.raises(openai.AuthenticationError) as info:
        server.client(key="sk-wrong").completions.create(model="tiny", prompt="hello", max_tokens=2)
    assert info.value.status_code == 401
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="gpt-4", prompt="hello", max_tokens=2)


def test_a_client_that_leaves_a_stream_frees_its_slot(server):
    before = _health(server)
    stream = server.client().completions.create(model="tiny", prompt="a long one", max_tokens=4000, temperature=0,
                                                stream=True)
    first = [chunk for _, chunk in zip(range(3), stream)]
    assert [c.choices[0].finish_reason for c in first] == [None] * 3  # still running when the client leaves
    stream.close()
    deadline = time.monotonic() + REQUEST_S
    while (stats := _health(server))["requests_finished"] == before["requests_finished"]:
        assert time.monotonic() < deadline, f"the abandoned request is still running: {stats}"
        time.sleep(0.1)
    assert stats["running"] == 0 and stats["tokens_generated"] - before["tokens_generated"] < 4000


def test_sigterm_lets_a_running_request_finish_then_exits_0(run_dir, tmp_path):
    srv = Server(run_dir, tmp_path)
    try:
        client = srv.client()
        stream = client.completions.create(model="tiny", prompt="hello", max_tokens=200, temperature=0, stream=True)
        chunks = iter(stream)
        first = next(chunks)
        srv.proc.send_signal(signal.SIGTERM)
        rest = list(chunks)
        assert first.choices[0].finish_reason is None
        assert (rest[-1].choices[0].finish_reason if rest else None) in ("length", "stop")
        assert srv.proc.wait(timeout=60) == 0, srv.logs()
        assert "lintime serve: stopped" in srv.err.read_text()
    finally:
        srv.stop()


# --- the command's own errors (no server) --------------------------------------------------------

def _one_line_error(capsys, rc: int) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("lintime: error:"), err
    return err[0]


def test_a_taken_port_is_one_line_before_the_model_loads(capsys, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        rc = main(["serve", str(tmp_path / "no-such-run"), "--port", str(port)])
    assert f"cannot listen on 127.0.0.1:{port}" in _one_line_error(capsys, rc)


@pytest.mark.parametrize("flags, needle", [(["--precision", "fp16"], "--precision"), (["--port", "70000"], "--port"),
                                           (["--log-level", "loud"], "--log-level"), (["--api-key", ""], "--api-key"),
                                           (["--max-batch", "0"], "--max-batch"), (["--name", ""], "--name")])
def test_bad_flags_are_one_line(capsys, tmp_path, flags, needle):
    assert needle in _one_line_error(capsys, main(["serve", str(tmp_path), *flags]))


def test_without_the_web_stack_it_names_the_extra(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # `import uvicorn` now fails
    line = _one_line_error(capsys, main(["serve", str(tmp_path)]))
    assert line == "lintime: error: lintime serve needs the serve extra: pip install -e '.[serve]'"


def test_help_imports_neither_torch_nor_the_web_stack():
    probe = ("import sys\nfrom lintime.cli import main\ntry:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in ('torch', 'starlette', 'uvicorn', 'anyio') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode == 0 and "--api-key" in res.stdout, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "[]"
