"""``lintime serve``: an OpenAI-compatible HTTP server over the continuous-batching engine."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sys
from pathlib import Path

from lintime.cli import CLIError, command, set_threads

API_KEY_ENV = "LINTIME_API_KEY"
DRAIN_S = 30.0  # on SIGTERM / Ctrl-C, running requests get this long to finish before they are cancelled
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@command
def serve(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    name: str | None = None,
    max_batch: int = 64,
    max_queue: int = 256,
    prefill_chunk: int = 4096,
    max_tokens_limit: int = 4096,
    device: str = "auto",
    precision: str = "auto",
    decode: str = "auto",
    threads: int = 0,
    log_level: str = "info",
) -> None:
    """Serve a causal LM over HTTP with OpenAI's completions API (POST /v1/completions, GET /v1/models, GET /health).

    Requests are decoded together by a continuous-batching engine: a new request joins the running
    batch at the next step, and a finished or abandoned one frees its slot at once.  SIGTERM or Ctrl-C
    stops taking connections, lets running requests finish (30 s at most, then cancels them) and
    exits 0.  Needs the serve extra (pip install -e '.[serve]'); see docs/serve.md.

    Args:
        model: run folder (its latest checkpoint), a step folder (runs/NAME/checkpoints/step_N) or a folder written by lintime export.
        host: address to listen on; the default answers this machine only (0.0.0.0: every interface -- set an API key).
        port: TCP port (0 = a free one, printed at start).
        api_key: clients must send 'Authorization: Bearer KEY' (None: the LINTIME_API_KEY environment variable's value, and no key when that is unset or empty).
        name: the model's name in the API (None: the folder's name, RUN/step_N for a step folder).
        max_batch: requests decoded together at most (batch slots).
        max_queue: requests waiting or running at most; past it a request is answered 503 (server busy).
        prefill_chunk: prompt tokens prefilled per engine iteration: whole prompts that fit go together in one packed call, a longer prompt is consumed in pieces of this size (so it shares the steps with running requests).
        max_tokens_limit: the largest max_tokens a request may ask for.
        device: auto (cuda when available), cpu, cuda or cuda:N.
        precision: auto (fp32: a request's greedy output does not depend on the batch it shares), fp32 or bf16 (faster on CUDA; greedy output may then change with the batch).
        decode: auto (graph on CUDA: each batch size's decoding step captured in a CUDA graph and replayed per token; eager elsewhere), graph or eager.
        threads: CPU threads (0 = auto: 1 for models under 20M parameters, else PyTorch's default).
        log_level: the server log's level: critical, error, warning, info, debug or trace.
    """
    if not 0 <= port <= 65535:
        raise CLIError(f"--port must be in 0..65535, got {port}")
    for flag, value in (("--max-batch", max_batch), ("--max-queue", max_queue), ("--prefill-chunk", prefill_chunk),
                        ("--max-tokens-limit", max_tokens_limit)):
        if value < 1:
            raise CLIError(f"{flag} must be >= 1, got {value}")
    if precision not in ("auto", "fp32", "bf16"):
        raise CLIError(f"--precision must be auto, fp32 or bf16, got {precision!r}")
    if decode not in ("auto", "graph", "eager"):
        raise CLIError(f"--decode must be auto, graph or eager, got {decode!r}")
    if log_level not in LOG_LEVELS:
        raise CLIError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
    if api_key == "":
        raise CLIError("--api-key must not be empty")
    api_key = api_key if api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    if name == "":
        raise CLIError("--name must not be empty")
    try:
        import uvicorn

        from lintime.serving.app import build_app
    except ImportError as err:
        if getattr(err, "name", None) in ("starlette", "uvicorn", "anyio", "h11"):
            raise CLIError("lintime serve needs the serve extra: pip install -e '.[serve]'") from None
        raise
    sock = _bind(host, port)  # before loading: a taken port fails now, not after the model is read
    try:
        _run(sock, model, host=host, api_key=api_key, name=name, max_batch=max_batch, max_queue=max_queue,
             prefill_chunk=prefill_chunk, max_tokens_limit=max_tokens_limit, device=device, precision=precision,
             decode=decode, threads=threads, log_level=log_level, uvicorn=uvicorn, build_app=build_app)
    finally:
        sock.close()


def _bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and not yet listening (a client is refused, not kept
    waiting, while the model loads)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as err:
        raise CLIError(f"--host {host!r}: {err.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as err:
        sock.close()
        raise CLIError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


def _is_loopback(sock: socket.socket) -> bool:
    try:
        return ipaddress.ip_address(sock.getsockname()[0].split("%")[0]).is_loopback
    except ValueError:
        return False


def _default_name(path: str) -> str:
    """The folder's name; a step folder (RUN/checkpoints/step_N) is named ``RUN/step_N``."""
    p = Path(path).expanduser().resolve()
    return f"{p.parent.parent.name}/{p.name}" if p.parent.name == "checkpoints" else p.name


def _server_class(uvicorn):
    class Server(uvicorn.Server):
        """uvicorn's server, which marks the app as closing as soon as a stop signal arrives (so
        /health answers 503 while running requests drain)."""

        def handle_exit(self, sig, frame) -> None:
            self.config.app.state.closing = True
            super().handle_exit(sig, frame)

    return Server


def _run(sock, model, *, host, api_key, name, max_batch, max_queue, prefill_chunk, max_tokens_limit, device, precision,
         decode, threads, log_level, uvicorn, build_app) -> None:
    import torch

    from lintime.cli.loading import load_checkpoint
    from lintime.serving import Engine
    from lintime.utils.device import pick_device

    dev = pick_device(device)
    loaded = load_checkpoint(model, device=dev)
    if loaded.config["objective"] != "clm":
        raise CLIError(f"{model} is a masked LM ({loaded.config['objective']}): only causal LMs generate text")
    set_threads(threads, device=str(dev), n_params=loaded.model.num_parameters())
    if precision == "bf16":  # auto = fp32: bf16 rounding moves with the batch's GEMM shapes and can flip a greedy token
        loaded.model.to(torch.bfloat16)
    name = name or _default_name(model)
    if decode == "graph" and dev.type != "cuda":
        raise CLIError(f"--decode graph needs a CUDA device, this server runs on {dev}")
    engine = Engine(loaded.model, loaded.tokenizer, max_batch=max_batch, max_queue=max_queue, prefill_chunk=prefill_chunk,
                    max_new_tokens_limit=max_tokens_limit, device=dev, graphs=decode != "eager" and dev.type == "cuda")
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    if gpu is not None:
        from lintime.utils.kernel_cache import first_start_notice, record_start

        notice = first_start_notice("serve", gpu)
        if notice is not None:
            print(notice, file=sys.stderr, flush=True)
    app = build_app(engine, model_name=name, api_key=api_key)
    address, port = sock.getsockname()[:2]
    server = _server_class(uvicorn)(uvicorn.Config(app, host=address, port=port, log_level=log_level,
                                                   timeout_graceful_shutdown=DRAIN_S, lifespan="on"))

    # uvicorn handles SIGINT / SIGTERM while it runs (stop accepting, drain, shut down) and raises the
    # signal again when it is done: these handlers take that second delivery, so the engine still
    # shuts down below and the command exits 0
    stopped: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _f: stopped.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
    engine.start()
    try:
        sock.listen(2048)  # from here a client waits in the backlog until uvicorn accepts it
        shown = f"[{address}]" if sock.family == socket.AF_INET6 else address
        dtype = "bf16" if next(loaded.model.parameters()).dtype == torch.bfloat16 else "fp32"
        steps = (f"decoding steps from CUDA graphs, {len(engine.buckets)} batch sizes captured in "
                 f"{engine.capture_s:.1f} s" if engine.graphs else "eager decoding steps")
        print(f"lintime serve: {name} at http://{shown}:{port}/v1 "
              f"({dev} {dtype}, {steps}, max batch {max_batch}{', API key required' if api_key else ''})", flush=True)
        if api_key is None and not _is_loopback(sock):
            print(f"lintime serve: warning: listening on {host} without an API key: anyone who can reach this port "
                  f"can use the model (set --api-key or {API_KEY_ENV})", file=sys.stderr, flush=True)
        if not stopped:  # a signal during the start-up already asked to stop
            server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.shutdown(timeout=DRAIN_S, cancel=True)
        if gpu is not None and engine.stats()["requests_finished"] > 0:
            record_start("serve", gpu)
    if stopped:
        print("lintime serve: stopped", file=sys.stderr, flush=True)
