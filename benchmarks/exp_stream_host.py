"""Host time of the mixed chunk backward's fork / join onto its second stream (``Blocks.bwd_streams``), no kernels.

    PYTHONPATH=$PWD python3 benchmarks/exp_stream_host.py

Compares ``mixed_chunk._Side`` (two reused events, ``torch.cuda.set_stream``) with the first form of session 13
(``Stream.wait_stream`` both ways, a new event each, and the ``torch.cuda.stream`` context manager).
"""

import time

import torch

from lintime.ops.mixed_chunk.triton.mixed_chunk import _on, _side_stream


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    dev = torch.device("cuda")
    side = _side_stream(dev)
    other = torch.cuda.Stream(device=dev)

    def reused_events():
        cur = side.fork()
        with _on(side, cur):
            pass
        side.join(cur)

    def wait_stream():
        cur = torch.cuda.current_stream(dev)
        other.wait_stream(cur)
        with torch.cuda.stream(other):
            pass
        cur.wait_stream(other)

    for f, name in ((reused_events, "reused events + set_stream (shipped)"), (wait_stream, "wait_stream + context")):
        for _ in range(200):
            f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5000):
            f()
        dt = (time.perf_counter() - t) / 5000 * 1e6
        torch.cuda.synchronize()
        print(f"{name}: {dt:.1f} us per backward (host)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
