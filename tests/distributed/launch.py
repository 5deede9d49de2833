"""Run a function on ``world`` CPU processes with the gloo backend, as torchrun would (the
``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_*`` environment), with a hard timeout:
a hung or failed rank fails the test instead of hanging CI."""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world: int, port: int, args: tuple, queue, timeout_s: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LINTIME_DIST_TIMEOUT_S=str(timeout_s))
    torch.set_num_threads(1)
    failed = False
    try:
        buf = io.BytesIO()  # tensors as bytes: shared-memory handles die with this process
        torch.save(fn(*args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 -- report every failure to the parent
        failed = True
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized() and not failed:
            dist.destroy_process_group()
    if failed:
        queue.close()
        queue.join_thread()  # the report reaches the parent before the process ends
        sys.exit(1)  # as a torchrun worker would


def run_ranks(fn, world: int, *args, timeout: float = 120.0, dist_timeout_s: int = 60) -> list:
    """``[fn(*args) on rank 0, ..., rank world-1]``; ``fn`` must be importable (module level).
    Raises ``RuntimeError`` with the failing rank's traceback, or on timeout."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, queue, dist_timeout_s), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    except Exception as err:
        if type(err).__name__ == "Empty":
            raise RuntimeError(f"timeout after {timeout:.0f} s: ranks {sorted(set(range(world)) - set(results))} hung") from None
        raise
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def run_ranks_outcome(fn, world: int, *args, timeout: float = 60.0, dist_timeout_s: int = 60) -> list[dict]:
    """Run ``fn(*args)`` on every rank and wait for every process to end by itself (failures
    included); ``[{"exitcode", "seconds", "status", "report"}]`` per rank, where a process still
    alive after ``timeout`` seconds is killed and reported with ``status "hung"``."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, queue, dist_timeout_s), daemon=True)
             for r in range(world)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    ended: dict[int, float] = {}
    while len(ended) < world and time.perf_counter() - t0 < timeout:
        for r, p in enumerate(procs):
            if r not in ended and not p.is_alive():
                ended[r] = time.perf_counter() - t0
        time.sleep(0.1)
    reports: dict[int, tuple] = {}
    with contextlib.suppress(Exception):
        while len(reports) < len(ended):  # every rank that ended by itself sent one report (unless it crashed)
            rank, status, value = queue.get(timeout=1.0)
            reports[rank] = (status, value)
    out = []
    for r, p in enumerate(procs):
        if r not in ended:
            p.kill()
        p.join(timeout=10)
        status, value = reports.get(r, ("none", ""))
        out.append({"exitcode": p.exitcode, "seconds": ended.get(r), "status": status if r in ended else "hung",
                    "report": value if status == "error" else ""})
    return out
