"""Sampling text from a causal LM through its decoding state.

    from lintime.generation import GenerationConfig, generate, stream
    samples = generate(model, tokenizer, "def parse(", GenerationConfig(max_new_tokens=200, top_p=0.9, num_samples=4))
    for piece in stream(model, tokenizer, "def parse(", GenerationConfig(stop=("\\n\\n",))):
        print(piece.text, end="", flush=True)

The loop (gpt-fast style): pack the prompts (each preceded by ``bos``, as training wraps every
document) and :func:`~lintime.generation.decode.prefill` them in chunks; replicate each
prompt's state ``num_samples`` times with ``state.select``; then draw a token for every row,
feed it, and repeat.  A row stops at ``eos``, at a stop string, or after ``max_new_tokens``
tokens.  Two ways to run the steps (``GenerationConfig.decode``):

* ``graph`` (the default on CUDA): the state is copied into fixed buffers
  (:class:`~lintime.generation.static.StaticDecoder`, KV caches at a capacity of the longest
  prompt + ``max_new_tokens``) and one step -- sampling included -- is captured in a CUDA graph and
  replayed per token (:mod:`lintime.generation.graphs`); the host reads the drawn tokens in
  batches (after 1, 2, 4, ... up to ``sync_every`` steps) for stop checks and streaming.  The batch
  keeps its size; a finished row's extra tokens are dropped.  ``static`` is the same loop without
  the graph.
* ``eager`` (the default elsewhere): :func:`~lintime.generation.decode.decode_one_token` per
  token; finished rows leave the batch (``state.select``), so the work per step shrinks.

Reproducibility: row ``r`` (sample ``j`` of prompt ``p``, ``r = p * num_samples + j``) draws its
uniform numbers from a hash of ``(seed + r, step)``
(:func:`~lintime.generation.sampling.sample_seeded`); its tokens depend on nothing else (not on
the other rows, when they stop, nor the decoding path), up to the last-bit differences a
different batch size or path can make in the logits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from lintime.generation.decode import (
    compiled_decode_one_token,
    decode_one_token,
    prefill,
    state_nbytes,
)
from lintime.generation.graphs import DecodeLoop, build_loop, token_blocks
from lintime.generation.sampling import sample_seeded
from lintime.generation.static import StaticDecoder
from lintime.generation.text import Detokenizer, StopMatcher


DECODE_PATHS = ("auto", "graph", "static", "eager")


@dataclass(frozen=True)
class GenerationConfig:
    """How to sample (validated on construction; the CLI flags of ``lintime generate``).

    ``max_new_tokens``  tokens to draw per sample at most (the ``eos`` that ends a sample counts);
    ``temperature``     logits are divided by it; 0 = greedy (argmax);
    ``top_k``           keep the ``k`` most likely tokens (0 = all);
    ``top_p``           keep the nucleus of probability ``p`` (1 = all);
    ``num_samples``     samples per prompt (decoded together as one batch);
    ``stop``            stop strings: a sample ends at the first one, which is not included;
    ``seed``            row ``r`` of the batch draws from a generator seeded with ``seed + r``;
    ``prefill_chunk``   prompt tokens per model call during prefill (0 = automatic: the whole prompt up to
                        ``lintime.generation.decode.PREFILL_TOKENS`` tokens per call);
    ``add_bos``         precede each prompt with ``bos`` (training wraps documents in bos/eos);
    ``stop_at_eos``     end a sample when it draws ``eos``;
    ``compile``         ``torch.compile`` the decoding step (the eager path);
    ``decode``          ``auto`` (``graph`` on CUDA, ``eager`` elsewhere or with ``compile``),
                        ``graph``, ``static`` or ``eager`` (see the module docstring);
    ``sync_every``      static / graph paths: most tokens drawn between two host reads.
    """

    max_new_tokens: int = 256
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    num_samples: int = 1
    stop: tuple[str, ...] = ()
    seed: int = 0
    prefill_chunk: int = 0
    add_bos: bool = True
    stop_at_eos: bool = True
    compile: bool = False
    decode: str = "auto"
    sync_every: int = 16

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not self.temperature >= 0:  # also catches NaN
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = all tokens), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0 = automatic), got {self.prefill_chunk}")
        if self.decode not in DECODE_PATHS:
            raise ValueError(f"decode must be one of {DECODE_PATHS}, got {self.decode!r}")
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")


@dataclass
class Sample:
    """One finished sample: ``text`` (without the stop string), every drawn ``token_ids``
    (including the ``eos`` or the tokens of the stop string that ended it), and why it ended:
    ``finish_reason`` in ``{"eos", "stop", "length"}``."""

    prompt_index: int
    sample_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(frozen=True)
class TextPiece:
    """A piece of streamed text of row ``row`` (= ``prompt_index * num_samples + sample_index``).
    The last piece of a row has ``finish_reason`` set (its text may be empty)."""

    row: int
    prompt_index: int
    sample_index: int
    text: str
    finish_reason: str | None = None


class _Row:
    """Host side of one row: its sample, incremental detokeniser and stop matcher."""

    def __init__(self, sample: Sample, tokenizer, cfg: GenerationConfig):
        self.sample, self.cfg, self.eos = sample, cfg, tokenizer.eos_id
        self.detok = Detokenizer(tokenizer)
        self.stop = StopMatcher(cfg.stop)

    def push(self, tok: int, last: bool) -> tuple[str, str | None]:
        """Take the drawn token ``tok`` (``last``: the row's ``max_new_tokens``-th); return the
        text that became final and the finish reason (``None``: the row goes on)."""
        r = self.sample
        r.token_ids.append(tok)
        if self.cfg.stop_at_eos and tok == self.eos:
            reason, new = "eos", self.detok.flush()
        else:
            reason, new = None, self.detok.push(tok)
            if last:
                reason, new = "length", new + self.detok.flush()
        shown, stopped = self.stop.push(new)
        if stopped:
            reason = "stop"
        elif reason is not None:
            shown += self.stop.flush()
        r.text += shown
        if reason is not None:
            r.finish_reason = reason
        return shown, reason

    def piece(self, i: int, shown: str, reason: str | None) -> TextPiece:
        return TextPiece(i, self.sample.prompt_index, self.sample.sample_index, shown, reason)


def _encode_prompts(tokenizer, prompts: list[str], add_bos: bool) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = ([tokenizer.bos_id] if add_bos else []) + list(tokenizer.encode(p))
        if not ids:
            raise ValueError("an empty prompt needs add_bos=True (the model needs at least one token to start from)")
        out.append(ids)
    return out


def _check_length(model, longest: int) -> None:
    cfg = getattr(model, "config", None)
    if getattr(cfg, "position", None) == "learned" and longest > cfg.max_positions:
        raise ValueError(
            f"prompt + max_new_tokens = {longest} tokens exceeds the model's learned position table "
            f"({cfg.max_positions} positions)"
        )


@torch.no_grad()
def stream(
    model, tokenizer, prompts: str | list[str], config: GenerationConfig | None = None, *, stats: dict | None = None,
) -> Iterator[TextPiece]:
    """Generate, yielding :class:`TextPiece` objects as text becomes final (see the module
    docstring).  ``prompts``: one string or a list; all their samples are decoded in one batch.
    The pieces of a row, concatenated, are exactly the text :func:`generate` returns for it.
    ``stats``: a dict to fill with counts and timings (see :func:`generate`)."""
    yield from _run(model, tokenizer, prompts, config or GenerationConfig(), samples_out=None, stats=stats)


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: str | list[str],
    config: GenerationConfig | None = None,
    *,
    on_text: Callable[[TextPiece], None] | None = None,
    stats: dict | None = None,
) -> list[Sample]:
    """Generate and return one :class:`Sample` per (prompt, sample), prompt-major.  ``on_text``,
    when given, is called with every :class:`TextPiece` as it is produced (streaming).

    ``stats``, when given, is filled with ``prompt_tokens`` (all prompts, bos included),
    ``new_tokens`` (drawn, all samples), ``prefill_s`` / ``decode_s`` (wall clock) and
    ``state_bytes_prefill`` / ``state_bytes_final``: the decoding state of one sequence after
    the prompt and after the last token fed (constant for the linear-time families; on the
    static / graph paths the KV caches at their full capacity); ``decode_path``: ``graph``,
    ``static`` (the static buffers stepped eagerly) or ``eager``; ``steps``: decoding steps run
    (each draws one token for every running sample; ``decode_s / steps`` is the time per token).
    """
    samples: list[Sample] = []
    for piece in _run(model, tokenizer, prompts, config or GenerationConfig(), samples_out=samples, stats=stats):
        if on_text is not None:
            on_text(piece)
    return samples


def _run(model, tokenizer, prompts, cfg: GenerationConfig, samples_out: list | None, stats: dict | None) -> Iterator[TextPiece]:
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts:
        raise ValueError("no prompt given")
    if getattr(model, "causal", True) is False:
        raise ValueError(f"{type(model).__name__} is bidirectional (masked LM): it cannot generate text")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        encoded = _encode_prompts(tokenizer, list(prompts), cfg.add_bos)
        _check_length(model, max(len(e) for e in encoded) + cfg.max_new_tokens)
        S = cfg.num_samples
        rows = [_Row(Sample(p, j), tokenizer, cfg) for p in range(len(encoded)) for j in range(S)]
        if samples_out is not None:
            samples_out.extend(r.sample for r in rows)
        if cfg.max_new_tokens == 0:
            for i, r in enumerate(rows):
                r.sample.finish_reason = "length"
                yield r.piece(i, "", "length")
            return

        # ---- prefill every prompt once (packed), then one state row per sample
        lens = [len(e) for e in encoded]
        ids = torch.tensor([t for e in encoded for t in e], dtype=torch.long, device=device)[None]  # [1, sum P]
        cu = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
        t0 = time.perf_counter()
        logits, state = prefill(model, ids, None, cfg.prefill_chunk, cu_seqlens=cu)  # [P, V]
        info = stats if stats is not None else {}
        info.update(prompt_tokens=sum(lens), new_tokens=0, prefill_s=time.perf_counter() - t0, decode_s=0.0,
                    state_bytes_prefill=state_nbytes(state) // state.batch_size)
        info["state_bytes_final"] = info["state_bytes_prefill"]
        t0 = time.perf_counter()
        replicate = torch.arange(len(encoded), device=device).repeat_interleave(S)  # [P * S]
        logits, state = logits.index_select(0, replicate), state.select(replicate)
        seeds = cfg.seed + torch.arange(len(rows), device=device)  # row r draws from seed + r
        path = decode_path(cfg, device)
        info["steps"] = 0
        if path == "eager":
            info["decode_path"] = "eager"
            yield from _decode_eager(model, cfg, rows, logits, state, seeds, info)
        else:
            capacity = max(lens) + cfg.max_new_tokens
            dec = StaticDecoder(model, state, capacity)
            del state
            loop = build_loop(dec, logits, seeds, cfg.max_new_tokens, graph=path == "graph",
                              temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
            info["decode_path"] = "graph" if loop.graph is not None else "static"
            info["setup_s"] = time.perf_counter() - t0  # the static buffers and the graph's capture, apart
            t0 = time.perf_counter()
            yield from _decode_loop(loop, cfg, rows, info)
            info["state_bytes_final"] = state_nbytes(dec.state) // dec.batch_size
        info["decode_s"] = time.perf_counter() - t0
    finally:
        model.train(was_training)


def decode_path(cfg: GenerationConfig, device: torch.device) -> str:
    """The decoding path ``cfg.decode`` resolves to on ``device``: ``auto`` is ``graph`` on CUDA
    (``eager`` with ``compile``, which wraps the eager step), ``eager`` elsewhere; CUDA graphs
    need a CUDA device (``graph`` elsewhere is ``static``)."""
    if cfg.decode == "auto":
        return "graph" if device.type == "cuda" and not cfg.compile else "eager"
    if cfg.decode == "graph" and device.type != "cuda":
        return "static"
    return cfg.decode


def _decode_eager(model, cfg, rows, logits, state, seeds, info) -> Iterator[TextPiece]:
    """One model call per token; the host reads every token; finished rows leave the batch."""
    step_fn = compiled_decode_one_token() if cfg.compile else decode_one_token
    step_t = torch.zeros((), dtype=torch.long, device=seeds.device)
    active = list(range(len(rows)))  # batch position -> row index
    for step in range(cfg.max_new_tokens):
        tokens = sample_seeded(logits, seeds, step_t, temperature=cfg.temperature, top_k=cfg.top_k,
                               top_p=cfg.top_p)  # [len(active)]
        info["new_tokens"] += len(active)
        info["steps"] = step + 1
        keep = []
        for pos, (i, tok) in enumerate(zip(active, tokens.tolist())):
            shown, reason = rows[i].push(tok, step == cfg.max_new_tokens - 1)
            if shown or reason is not None:
                yield rows[i].piece(i, shown, reason)
            if reason is None:
                keep.append(pos)
        if not keep:
            break
        if len(keep) < len(active):  # finished rows leave the batch
            idx = torch.tensor(keep, device=seeds.device)
            state, tokens, seeds = state.select(idx), tokens.index_select(0, idx), seeds.index_select(0, idx)
            active = [active[k] for k in keep]
        logits, state = step_fn(model, tokens, state)
        step_t += 1
        info["state_bytes_final"] = state_nbytes(state) // state.batch_size


def _decode_loop(loop: DecodeLoop, cfg, rows, info) -> Iterator[TextPiece]:
    """Replays of ``loop`` read in blocks (:func:`lintime.generation.graphs.token_blocks`); each block's tokens are
    pushed step by step, row by row, so the pieces stream in the order eager decoding gives."""
    M = cfg.max_new_tokens
    live = list(range(len(rows)))
    for done, block in token_blocks(loop, M, cfg.sync_every, live):
        n = len(block[live[0]])  # steps in this block
        for j in range(n):
            still = []
            for i in live:
                info["new_tokens"] += 1
                shown, reason = rows[i].push(block[i][j], done + j == M - 1)
                if shown or reason is not None:
                    yield rows[i].piece(i, shown, reason)
                if reason is None:
                    still.append(i)
            live[:] = still
        info["steps"] = done + n  # replays run (a row that ended inside a block still ran to its end)
