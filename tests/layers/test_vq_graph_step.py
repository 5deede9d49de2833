"""Transformer-VQ's training step as :class:`lintime.training.graphed.GraphedStep` captures it (``vq-base@graph``).

A CUDA graph replays device work only: a step that reads a value back to the host, sizes a tensor from values, or
builds a tensor from host data fails to capture (or replays stale values).  On the CPU:

* the step's body, on the Triton path (through the interpreter) that CUDA tensors take, makes no such call inside
  lintime -- counted by :func:`lintime.generation.profiling.count_host_syncs`, the counter of the decoding tests;
  the layer's quantisation, commitment loss and EMA codebook update included;
* the body run eagerly (``capture=False``, the ``[rows, T]`` layout) equals the trainer's step on the same rows in
  the packed layout (``forward_backward`` + clip + AdamW): loss, gradient norm, every parameter and the EMA
  codebook buffers (fp32 exact rule), over steps with a changing rate.

On CUDA: the captured step against the same step run eagerly (scatter-adds with atomics make the two differ by
rounding only, so the rule is 1 % per step's loss, not bitwise).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lintime.data.packing import Batch
from lintime.generation.profiling import count_host_syncs
from lintime.layers.vq import VQAttention
from lintime.models import CausalLM, get_preset
from tolerances import assert_exact
from lintime.training import parallel as par
from lintime.training.graphed import GraphedStep, one_sequence_per_row
from lintime.training.step import forward_backward

AUX = 1e-4  # the vq recipe's commitment weight (seed Eq. 35)


def _cfg(n_layers=2):
    """vq-tiny narrowed so that the interpreter runs a step in seconds: L = 16 (T = 64 is 4 blocks: the cache is
    used), S = 16 codes, K = 16."""
    cfg = get_preset("vq-tiny", n_layers=n_layers)
    return dataclasses.replace(cfg, d_model=32, mixer=dataclasses.replace(cfg.mixer, n_codes=16, block_len=16,
                                                                          d_k=16))


def _model(cfg, backend, device="cpu"):
    torch.manual_seed(0)
    model = CausalLM(cfg).to(device).train()
    for m in model.modules():
        if isinstance(m, VQAttention):
            m.backend = backend
    fused = {"fused": True} if torch.device(device).type == "cuda" else {}
    return model, torch.optim.AdamW(model.param_groups(0.01), lr=1e-3, betas=(0.9, 0.99), **fused)


def _batch(cfg, B, T, seed) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    targets[0, : T // 4] = -100
    zeros = torch.zeros(B, T, dtype=torch.long)
    cu = torch.tensor([0, B * T], dtype=torch.int32)  # replaced by one sequence per row
    rows = torch.arange(B)
    return one_sequence_per_row(Batch(ids, targets, cu, zeros, zeros, rows, torch.zeros(B, dtype=torch.long)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU tensors)")
def test_step_body_makes_no_host_read_on_the_triton_path():
    """Every call the counter flags during one body (forward, commit loss, EMA update, backward, clip, optimizer),
    where a lintime frame made it.  The CPU AdamW reads its step counts (``item``) inside torch: the fused CUDA
    optimizer the graph step requires does not, so those are not lintime's and not counted."""
    import traceback

    cfg = _cfg(n_layers=1)
    model, opt = _model(cfg, "triton")
    B, T = 2, 64
    step = GraphedStep(model, opt, rows=B, context_len=T, clip=1.0, aux_weight=AUX, capture=False)
    batch = _batch(cfg, B, T, 0)
    step.input_ids.copy_(batch.input_ids)
    step.targets.copy_(batch.targets)
    ours: list[str] = []

    class Sites(type(count_host_syncs())):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            before = self.total + self.h2d
            out = super().__torch_function__(func, types, args, kwargs)
            if self.total + self.h2d > before:
                stack = traceback.extract_stack()[:-1]
                if not any("/torch/optim/" in f.filename for f in stack):
                    ours.append(f"{getattr(func, '__name__', func)} at " + "; ".join(
                        f"{f.filename.rsplit('/lintime/', 1)[-1]}:{f.lineno}" for f in stack[-3:]))
            return out

    before = [b.clone() for b in model.buffers()]
    with Sites() as c:
        opt.zero_grad(set_to_none=True)
        out = step._body()
    assert ours == [], ours
    assert c.ops > 100  # the counter saw the step
    assert torch.isfinite(out.loss) and float(out.aux) > 0  # the commitment loss is in the step
    assert any(not torch.equal(a, b) for a, b in zip(before, model.buffers()))  # the EMA update ran


@pytest.mark.parametrize("backend", ["chunk", pytest.param("triton", marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter test (CPU tensors)"))])
def test_graph_step_body_equals_the_trainer_step(backend):
    """fp32 exact rule.  The body runs the ``[rows, T]`` layout (no ``cu_seqlens``: the Triton path's
    whole-block placement, no host values), the trainer the packed layout of the same rows."""
    cfg = _cfg(n_layers=2 if backend == "chunk" else 1)  # the interpreter: one layer
    B, T = 2, 64 if backend == "chunk" else 48  # 48: three blocks of 16, the cache in use from the third
    ref, ref_opt = _model(cfg, backend)
    model, opt = _model(cfg, backend)
    step = GraphedStep(model, opt, rows=B, context_len=T, clip=0.5, aux_weight=AUX, capture=False)
    for i in range(2):
        batch, lr = _batch(cfg, B, T, i), 1e-3 * (i + 1)
        for group in ref_opt.param_groups:
            group["lr"] = lr
        loss, aux = forward_backward(ref, batch, micro_rows=B, aux_weight=AUX)
        norm = par.clip_grad_norm(ref, 0.5)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        out = step.step(batch.input_ids, batch.targets, lr)
        assert_exact(f"{backend} step {i} loss", torch.tensor(loss), out.loss)
        assert_exact(f"{backend} step {i} aux", torch.tensor(aux), out.aux)
        assert_exact(f"{backend} step {i} grad norm", torch.tensor(norm), out.grad_norm)
        assert aux > 0
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert_exact(name, p.detach(), q.detach())
    for (name, b), c in zip(ref.named_buffers(), model.buffers()):
        if b.is_floating_point():
            assert_exact(name, b, c)  # codebook_count / codebook_sum after two EMA updates


@pytest.mark.cuda
def test_captured_vq_step_replays_the_eager_step():
    """vq-small (L = 128, S = 256) at T = 512 on bf16 autocast, 4 steps: the step captures (no host read on its
    path) and each replayed step's loss is within 1 % of the eager step's; the EMA buffers moved the same way
    (within 1 %, relative RMS).  A stale batch, a lost EMA update or a missed rate moves them by more."""
    from tolerances import rel_rms

    cfg = get_preset("vq-small", n_layers=2)
    B, T = 4, 512
    runs = []
    for capture in (False, True):
        model, opt = _model(cfg, None, "cuda")
        step = GraphedStep(model, opt, rows=B, context_len=T, clip=1.0, aux_weight=AUX, autocast=torch.bfloat16,
                           capture=capture)
        losses = []
        for i in range(4):
            batch = _batch(cfg, B, T, i)
            out = step.step(batch.input_ids, batch.targets, 1e-3 * (1 + i % 2))
            assert out is not None, step.failed
            losses.append(float(out.loss))
        torch.cuda.synchronize()
        runs.append((losses, [b.float() for b in model.buffers() if b.is_floating_point()]))
    (l0, b0), (l1, b1) = runs
    for i, (a, b) in enumerate(zip(l0, l1)):
        assert abs(a - b) <= 0.01 * abs(a), (i, a, b)
    assert l0[0] != l0[-1]  # the steps trained
    for x, y in zip(b0, b1):
        assert rel_rms(x, y) <= 0.01
