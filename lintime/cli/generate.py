"""``lintime generate``: sample text from a checkpoint, streamed to stdout."""

from __future__ import annotations

import sys
import time

from lintime.cli import CLIError, command, set_threads

PROGRESS_EVERY_S = 30.0  # with --num-samples N and no terminal, a progress line this often

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text: str) -> str:
    r"""Interpret ``\n``, ``\t``, ``\r`` and ``\\`` (only those; any other character, non-ASCII
    included, is kept as it is), so ``--stop '\n\n'`` means two newlines."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in _ESCAPES:
            out.append(_ESCAPES[text[i + 1]])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


@command
def generate(
    checkpoint: str,
    prompt: str = "",
    max_new_tokens: int = 256,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 1.0,
    num_samples: int = 1,
    stop: str | None = None,
    seed: int = 0,
    prefill_chunk: int = 0,
    device: str = "auto",
    echo: bool = True,
    compile: bool = False,
    decode: str = "auto",
    stats: bool = True,
    threads: int = 0,
) -> None:
    r"""Sample text from a causal LM, streamed to stdout as it is decoded.

    The prompt (preceded by bos, as every training document) is prefilled in chunks through the
    model's decoding state, then tokens are drawn one at a time from the state -- constant
    memory per token for the linear-time families.  With --num-samples N the samples are
    decoded together as one batch and each is printed when it is finished.

    Args:
        checkpoint: run folder (its latest checkpoint), a step folder (runs/NAME/checkpoints/step_N) or a folder written by lintime export.
        prompt: text to continue (empty: start from bos alone).
        max_new_tokens: tokens to draw per sample at most.
        temperature: divide the logits by this; 0 = greedy.
        top_k: sample from the k most likely tokens only (0 = all).
        top_p: sample from the smallest set of tokens whose probability reaches p (1 = all).
        num_samples: samples of the prompt, decoded as one batch.
        stop: stop string: a sample ends before its first occurrence (\n, \t, \r and \\ are interpreted).
        seed: sample i draws from a generator seeded with seed + i (same seed, same text).
        prefill_chunk: prompt tokens per model call during prefill (0 = automatic: the whole prompt, up to 32768 tokens per call).
        device: auto (cuda when available), cpu, cuda or cuda:N.
        echo: print the prompt before the generated text.
        compile: torch.compile the decoding step (the eager path).
        decode: auto (graph on CUDA: one decoding step captured in a CUDA graph and replayed per token; eager elsewhere), graph, static (the graph's in-place state buffers, stepped eagerly) or eager.
        stats: print tokens generated, ms per token, the decoding path, tokens/s and the decoding-state size on stderr at the end (and, with several samples, a progress line on stderr every 30 seconds).
        threads: CPU threads (0 = auto: 1 for models under 20M parameters, else PyTorch's default).
    """
    from lintime.cli.loading import load_checkpoint
    from lintime.generation import GenerationConfig, stream
    from lintime.utils.device import pick_device

    config = GenerationConfig(  # ValueError (one line, exit 2) for a bad value
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        num_samples=num_samples, stop=(unescape(stop),) if stop else (), seed=seed, prefill_chunk=prefill_chunk,
        compile=compile, decode=decode,
    )
    dev = pick_device(device)
    loaded = load_checkpoint(checkpoint, device=dev)
    set_threads(threads, device=str(dev), n_params=loaded.model.num_parameters())
    if loaded.config["objective"] != "clm":
        raise CLIError(f"{checkpoint} is a masked LM ({loaded.config['objective']}): only causal LMs generate text")
    gpu = _first_start(dev)

    out = sys.stdout
    pending: dict[int, list[str]] = {}
    info: dict = {}
    if num_samples == 1 and echo:
        out.write(prompt)
        out.flush()
    last, drawn = time.monotonic(), 0
    try:
        for piece in stream(loaded.model, loaded.tokenizer, prompt, config, stats=info):
            if num_samples == 1:  # live
                out.write(piece.text + ("\n" if piece.finish_reason else ""))
                out.flush()
                continue
            drawn += 1
            if stats and time.monotonic() - last >= PROGRESS_EVERY_S:
                last = time.monotonic()
                print(f"lintime generate: {drawn:,} tokens drawn over {num_samples} samples", file=sys.stderr, flush=True)
            pending.setdefault(piece.row, []).append(piece.text)
            if piece.finish_reason is not None:  # several samples interleave: print each one whole
                text = "".join(pending.pop(piece.row))
                out.write(f"=== sample {piece.sample_index} ({piece.finish_reason}) ===\n{prompt if echo else ''}{text}\n")
                out.flush()
    except BrokenPipeError:  # `lintime generate ... | head`: the reader left, stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    if gpu is not None:
        from lintime.utils.kernel_cache import record_start

        record_start("generate", gpu)
    if stats and info:
        print(stats_line(info, num_samples), file=sys.stderr)


def _first_start(dev) -> str | None:
    """The CUDA device's model name (``None`` off CUDA, where no kernel compiles), after the first-start notice
    where no generation finished on that GPU model before (:mod:`lintime.utils.kernel_cache`)."""
    if dev.type != "cuda":
        return None
    import torch

    from lintime.utils.kernel_cache import first_start_notice

    gpu = torch.cuda.get_device_name(dev)
    notice = first_start_notice("generate", gpu)
    if notice is not None:
        print(notice, file=sys.stderr, flush=True)
    return gpu


def stats_line(info: dict, num_samples: int) -> str:
    """The end-of-run line from :func:`lintime.generation.generate`'s ``stats``: prefill, tokens
    generated, ms per token (per decoding step: one token for each of ``num_samples`` samples),
    the decoding path, tokens/s and the state's size."""
    rate = info["new_tokens"] / info["decode_s"] if info["decode_s"] > 0 else float("inf")
    steps = info.get("steps") or 0
    per = f"{1e3 * info['decode_s'] / steps:.2f} ms per {'token' if num_samples == 1 else 'step'}" if steps else "-"
    batch = f" of {num_samples} samples" if num_samples > 1 else ""
    setup = f"decoder set-up {info['setup_s']:.2f} s; " if info.get("setup_s") is not None else ""
    return (f"[prefill {info['prompt_tokens']} tokens in {info['prefill_s']:.2f} s; {setup}{info['new_tokens']} new tokens in "
            f"{info['decode_s']:.2f} s ({per}{batch}, {info.get('decode_path', 'eager')} path, {rate:.1f} tokens/s); "
            f"decoding state per sample {_kib(info['state_bytes_prefill'])} after the prompt, "
            f"{_kib(info['state_bytes_final'])} at the end]")


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"
