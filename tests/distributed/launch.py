"""Run a function on ``world`` CPU processes with the gloo backend, as torchrun would (the
``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_*`` environment), with a hard timeout:
a hung or failed rank fails the test instead of hanging CI."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import traceback

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world: int, port: int, args: tuple, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LINTIME_DIST_TIMEOUT_S="60")
    torch.set_num_threads(1)
    try:
        buf = io.BytesIO()  # tensors as bytes: shared-memory handles die with this process
        torch.save(fn(*args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 -- report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 120.0) -> list:
    """``[fn(*args) on rank 0, ..., rank world-1]``; ``fn`` must be importable (module level).
    Raises ``RuntimeError`` with the failing rank's traceback, or on timeout."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, queue), daemon=True) for r in range(world)]
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
