"""``lintime train --compile``'s modes and the CUDA-graph training step (lintime/training/graphed.py).

CPU: which form each mode takes and the line it prints; the graph step's body run eagerly equals the trainer's eager
step (fp32 exact rule) with accumulation, clipping and a changing rate; a CPU run with ``--compile`` (auto) trains
eagerly after one notice.  CUDA: the captured step replays bit for bit what the same step computes eagerly.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lintime.data.packing import Batch
from lintime.models import CausalLM, get_preset
from tolerances import assert_exact
from lintime.training import TrainConfig, train
from lintime.training import parallel as par
from lintime.training.compile import choose_compile
from lintime.training.graphed import GraphedStep, one_sequence_per_row
from lintime.training.metrics import read_metrics
from lintime.training.step import forward_backward

CUDA = torch.device("cuda")  # a device object needs no GPU: choose_compile only reads its type


def test_compile_modes_and_their_one_line():
    cpu = torch.device("cpu")
    assert choose_compile("off", device=CUDA, distributed=False, packing="rows") == ("off", None)
    assert choose_compile("model", device=cpu, distributed=False, packing="documents") == ("model", None)
    mode, line = choose_compile("auto", device=CUDA, distributed=False, packing="rows")
    assert mode == "graph" and "captured in one CUDA graph" in line
    mode, line = choose_compile("graph", device=CUDA, distributed=False, packing="rows")
    assert mode == "graph"
    # documents packed anew every batch: captured where the model plans them on the device
    mode, line = choose_compile("auto", device=CUDA, distributed=False, packing="documents", static_packing=True)
    assert mode == "graph" and "documents" in line
    # where the step cannot be captured: a CPU, several processes, a layout the model plans on the host
    # DDP: two graphs per rank around the gradients' all-reduce
    mode, line = choose_compile("auto", device=CUDA, distributed=True, packing="documents", static_packing=True,
                                parallel="ddp")
    assert mode == "graph" and "two CUDA graphs" in line and "summed over the ranks" in line
    # where the step cannot be captured: a CPU, FSDP2 / context parallelism, DDP of a model whose forward writes
    # buffers, a layout the model plans on the host
    for kw, why in ((dict(device=cpu, distributed=False, packing="rows"), "CUDA device"),
                    (dict(device=CUDA, distributed=True, packing="rows", parallel="fsdp", cp_size=2), "context"),
                    (dict(device=CUDA, distributed=True, packing="rows", parallel="ddp", cp_size=2), "context"),
                    (dict(device=CUDA, distributed=True, packing="rows", parallel="ddp", updates_buffers=True),
                     "buffers"),
                    (dict(device=CUDA, distributed=False, packing="documents"), "--packing rows")):
        for asked in ("auto", "graph"):
            mode, line = choose_compile(asked, **kw)
            if asked == "auto" and kw["device"].type == "cpu":  # the default on a CPU: nothing to say
                assert (mode, line) == ("off", None)
                continue
            assert mode == "off" and why in line and "\n" not in line, (asked, kw, line)
    with pytest.raises(ValueError, match="compile mode"):
        choose_compile("fast", device=cpu, distributed=False, packing="rows")


def test_fsdp_takes_the_blocks_compiled_with_one_line():
    """FSDP2 (no context parallelism) on CUDA: ``auto`` runs eager steps, says why there is no graph and names
    ``--compile model``; ``model`` compiles the blocks after sharding and says so; ``graph`` still cannot capture (eager, with the reason); a
    CPU run's ``auto`` stays eager and silent (tests/distributed/test_fsdp_compiled_step.py runs the compiled form)."""
    fsdp = dict(distributed=True, packing="documents", static_packing=True, parallel="fsdp")
    for layout in ("documents", "rows"):
        mode, line = choose_compile("auto", device=CUDA, **{**fsdp, "packing": layout})
        assert mode == "off" and "\n" not in line, line
        assert "no CUDA graph (FSDP2 all-gathers" in line and "eager steps (--compile model: each block compiled" in line
    mode, line = choose_compile("model", device=CUDA, **fsdp)
    assert mode == "model" and line.startswith("lintime train: --compile model: each block compiled")
    mode, line = choose_compile("graph", device=CUDA, **fsdp)
    assert mode == "off" and "FSDP2" in line and line.endswith("eager steps")
    assert choose_compile("auto", device=torch.device("cpu"), **fsdp) == ("off", None)
    # under FSDP2 with context parallelism the mixers hand states between ranks: eager, and `model` as it always was
    mode, line = choose_compile("auto", device=CUDA, **fsdp, cp_size=2)
    assert mode == "off" and "context parallelism" in line
    assert choose_compile("model", device=CUDA, **fsdp, cp_size=2) == ("model", None)
    # a single process and DDP are unchanged: `model` is the whole model, said nothing about
    assert choose_compile("model", device=CUDA, distributed=True, packing="rows", parallel="ddp") == ("model", None)


def test_the_older_bool_flag_still_means_on_and_off():
    assert TrainConfig(compile=True).compile == "auto"
    assert TrainConfig(compile=False).compile == "off"
    assert TrainConfig.from_dict({"compile": False}).compile == "off"  # a config.json written before the modes
    with pytest.raises(ValueError, match="compile must be one of"):
        TrainConfig(compile="fast")
    with pytest.raises(ValueError, match="packing must be one of"):
        TrainConfig(packing="bytes")


def test_compile_flag_takes_an_optional_mode():
    from lintime.cli import build_parser

    parser = build_parser()
    for argv, want in ((["--compile"], True), (["--compile", "graph", "--steps", "2"], "graph"),
                       (["--compile", "--steps", "2"], True), (["--no-compile"], False)):
        assert vars(parser.parse_args(["train", *argv]))["compile"] == want, argv
    assert "compile" not in vars(parser.parse_args(["train"]))  # the config's default applies


def _batch(cfg, B: int, T: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    targets[0, : T // 3] = -100  # some tokens predict nothing
    cu = torch.tensor([0, T // 2, B * T], dtype=torch.int32)  # documents, replaced by the row layout below
    zeros = torch.zeros(B, T, dtype=torch.long)
    return one_sequence_per_row(Batch(ids, targets, cu, zeros, zeros, torch.arange(B), torch.zeros(B, dtype=torch.long)))


def _model(cfg, device="cpu"):
    torch.manual_seed(0)
    model = CausalLM(cfg).to(device)
    fused = {"fused": True} if torch.device(device).type == "cuda" else {}
    return model, torch.optim.AdamW(model.param_groups(0.01), lr=1e-3, betas=(0.9, 0.99), **fused)


def test_graph_step_body_equals_the_trainer_step_on_cpu():
    """Accumulation over 2 micro-batches, clipping that bites (0.1), a rate that changes every step: the step a graph
    would hold, run eagerly, against forward_backward + clip_grad_norm + AdamW (fp32 exact rule)."""
    cfg = get_preset("flash-tiny", n_layers=2)
    B, T = 4, 32
    ref, ref_opt = _model(cfg)
    model, opt = _model(cfg)
    step = GraphedStep(model, opt, rows=B, context_len=T, micro_rows=2, clip=0.1, capture=False)
    for i in range(3):
        batch, lr = _batch(cfg, B, T, i), 1e-3 * (i + 1)
        for group in ref_opt.param_groups:
            group["lr"] = lr
        loss, _ = forward_backward(ref, batch, micro_rows=2)
        norm = par.clip_grad_norm(ref, 0.1)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        out = step.step(batch.input_ids, batch.targets, lr)
        assert_exact(f"step {i} loss", torch.tensor(loss), out.loss)  # fp32: the rule's fp32 tolerance
        assert_exact(f"step {i} grad norm", torch.tensor(norm), out.grad_norm)
        assert norm > 0.1  # the clip was active
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert_exact(name, p.detach(), q.detach())


def test_graph_step_refuses_what_it_cannot_capture():
    cfg = get_preset("flash-tiny", n_layers=1)
    model, opt = _model(cfg)
    with pytest.raises(ValueError, match="CUDA"):
        GraphedStep(model, opt, rows=2, context_len=16)
    with pytest.raises(ValueError, match="must divide"):
        GraphedStep(model, opt, rows=3, context_len=16, micro_rows=2, capture=False)


def test_cpu_run_with_compile_graph_trains_eagerly_after_one_line(tiny_config, tmp_path):
    lines: list[str] = []
    graph = train(tiny_config(steps=2, compile="graph", packing="rows", sample_tokens=0), out=tmp_path, name="graph",
                  progress=False, echo=lines.append)
    auto: list[str] = []
    off = train(tiny_config(steps=2, packing="rows", sample_tokens=0), out=tmp_path, name="off", progress=False,
                echo=auto.append)
    notes = [line for line in lines if "--compile" in line]
    assert len(notes) == 1 and "no CUDA graph" in notes[0] and "eager steps" in notes[0], notes
    assert TrainConfig().compile == "auto" and not [line for line in auto if "--compile" in line]  # the default
    losses = [[r["loss"] for r in read_metrics(run.run_dir) if "loss" in r] for run in (graph, off)]
    assert losses[0] == losses[1] and len(losses[0]) == 2


def _doc_batch(cfg, B: int, T: int, seed: int, docs_per_row: int) -> Batch:
    """A batch packed by documents: ``docs_per_row`` documents of random lengths in every row (an empty last one
    where two boundaries meet), targets ignored at each document's last token as the data pipeline does."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    cu = [0]
    for r in range(B):
        cuts = sorted(torch.randint(1, T, (docs_per_row - 1,), generator=g).unique().tolist())
        cu += [r * T + c for c in cuts] + [(r + 1) * T]
    for end in cu[1:]:
        targets.view(-1)[end - 1] = -100
    zeros = torch.zeros(B, T, dtype=torch.long)
    return Batch(ids, targets, torch.tensor(cu, dtype=torch.int32), zeros, zeros, torch.arange(B),
                 torch.zeros(B, dtype=torch.long))


@pytest.mark.parametrize("preset", ["flash-tiny", "transformer-pp-tiny"])
def test_graph_step_on_packed_documents_equals_the_trainer_step_on_cpu(preset):
    """The documents layout (static cu_seqlens buffers padded with empty documents) against the trainer's eager
    packed step, with a batch that has more documents than the buffers hold (they grow), fp32 exact rule."""
    cfg = get_preset(preset, n_layers=2)
    B, T = 4, 48
    ref, ref_opt = _model(cfg)
    model, opt = _model(cfg)
    assert model.backbone.static_packing()
    step = GraphedStep(model, opt, rows=B, context_len=T, micro_rows=2, clip=0.1, capture=False, doc_capacity=2)
    capacities = []
    for i, docs in enumerate((2, 3, 5)):
        batch, lr = _doc_batch(cfg, B, T, i, docs), 1e-3 * (i + 1)
        for group in ref_opt.param_groups:
            group["lr"] = lr
        loss, _ = forward_backward(ref, batch, micro_rows=2)
        norm = par.clip_grad_norm(ref, 0.1)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        out = step.step(batch.input_ids, batch.targets, lr, cu_seqlens=batch.cu_seqlens)
        capacities.append(step.doc_capacity)
        assert_exact(f"step {i} loss", torch.tensor(loss), out.loss)
        assert_exact(f"step {i} grad norm", torch.tensor(norm), out.grad_norm)
    assert capacities[0] >= 4 and capacities[-1] >= 10 and capacities == sorted(capacities)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        # softmax's key bias has a zero gradient up to rounding (shift invariance): AdamW's g / sqrt(v) turns that
        # rounding into the whole update, so its parameters are compared through the loss and gradient norm only
        if not name.endswith("qkv.bias"):
            assert_exact(name, p.detach(), q.detach())
    with pytest.raises(ValueError, match="cu_seqlens"):
        step.step(batch.input_ids, batch.targets, 1e-3)


def test_families_that_plan_packing_on_the_host_say_so():
    assert not CausalLM(get_preset("vq-tiny")).backbone.static_packing()
    assert not CausalLM(get_preset("linear-tiny")).backbone.static_packing()  # learned positions
    assert CausalLM(get_preset("gla-tiny")).backbone.static_packing()
    assert CausalLM(get_preset("flash-tiny")).backbone.static_packing()


def test_rows_packing_makes_every_row_one_sequence():
    cfg = get_preset("flash-tiny")
    batch = _batch(cfg, 3, 8, 0)
    assert batch.cu_seqlens.tolist() == [0, 8, 16, 24]
    assert batch.position_ids.tolist() == [list(range(8))] * 3


def test_unfused_run_trains_like_the_fused_one_on_cpu(tiny_config, tmp_path):
    """--no-fused on the CPU: the same chunked ops, the plain loss instead of the fused one (fp32 exact rule)."""
    runs = [train(tiny_config(preset="flash-tiny", steps=2, fused=fused, sample_tokens=0), out=tmp_path,
                  name=str(fused), progress=False, echo=None) for fused in (True, False)]
    a, b = (torch.tensor([r["loss"] for r in read_metrics(run.run_dir) if "loss" in r]) for run in runs)
    assert len(a) == 2
    assert_exact("unfused losses", a.float(), b.float())


def test_set_fused_reaches_every_fused_layer():
    model = CausalLM(get_preset("flash-tiny"))
    fused = [m for m in model.modules() if isinstance(getattr(m, "fused", None), bool)]
    kinds = [type(m).__name__ for m in fused]
    assert kinds.count("FLASH") == model.config.n_layers and kinds.count("LayerNorm") == model.config.n_layers + 1
    model.set_fused(False)
    assert not any(m.fused for m in fused)
    model.set_fused(True)
    assert all(m.fused for m in fused)


# ---------------------------------------------------------------------------------------------
# CUDA: the captured step against the same step run eagerly


def _cuda_run(cfg, capture: bool, steps: int, B: int, T: int, docs: tuple[int, ...] | None = None):
    """``docs``: the documents layout, batch ``i`` with ``docs[i % len(docs)]`` documents a row."""
    model, opt = _model(cfg, "cuda")
    step = GraphedStep(model, opt, rows=B, context_len=T, micro_rows=B // 2, clip=0.1, autocast=torch.bfloat16,
                       capture=capture, doc_capacity=None if docs is None else B)
    losses = []
    for i in range(steps):
        if docs is None:
            batch, cu = _batch(cfg, B, T, i), None
        else:
            batch = _doc_batch(cfg, B, T, i, docs[i % len(docs)])
            cu = batch.cu_seqlens
        out = step.step(batch.input_ids, batch.targets, 1e-3 * (1 + i % 3), cu_seqlens=cu)
        losses.append((out.loss.clone(), out.grad_norm.clone()))
    torch.cuda.synchronize()
    assert step.failed is None, step.failed
    return model, losses


@pytest.mark.cuda
@pytest.mark.parametrize("preset", ["flash-small", "gla-small"])
def test_captured_step_replays_the_eager_step_bit_for_bit(preset):
    """Rule: bitwise.  A replay launches the kernels the eager step launches, with the same inputs, in the same order;
    these models' kernels are deterministic (no atomics: FLASH without its relative-bias gradient, GLA), so nothing
    may differ -- losses, gradient norms and every parameter after 5 steps of bf16 autocast, accumulation over two
    micro-batches, clipping and a changing rate."""
    cfg = get_preset(preset)
    if cfg.family == "flash":
        cfg = dataclasses.replace(cfg, mixer=dataclasses.replace(cfg.mixer, rel_bias=False))
    eager, eager_losses = _cuda_run(cfg, capture=False, steps=5, B=4, T=512)
    graphed, graph_losses = _cuda_run(cfg, capture=True, steps=5, B=4, T=512)
    for i, ((l0, n0), (l1, n1)) in enumerate(zip(eager_losses, graph_losses)):
        assert torch.equal(l0, l1) and torch.equal(n0, n1), (i, float(l0), float(l1), float(n0), float(n1))
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.cuda
@pytest.mark.parametrize("preset", ["flash-small", "transformer-pp-small"])
def test_captured_packed_documents_step_replays_the_eager_one(preset):
    """The documents layout captured: batches with other boundaries every step (2, 3, 1 documents a row; the buffers
    grow once, a second capture), each replay against the same static-buffer step run eagerly.  FLASH without its
    relative-bias gradient (atomics): bitwise; softmax attention's varlen backward is not deterministic: 1 % per step
    and the parameters by the half rule.  A stale plan (the first batch's boundaries replayed) fails either."""
    cfg = get_preset(preset)
    if cfg.family == "flash":
        cfg = dataclasses.replace(cfg, mixer=dataclasses.replace(cfg.mixer, rel_bias=False))
    eager, eager_losses = _cuda_run(cfg, capture=False, steps=6, B=4, T=512, docs=(2, 3, 1))
    graphed, graph_losses = _cuda_run(cfg, capture=True, steps=6, B=4, T=512, docs=(2, 3, 1))
    for i, ((l0, n0), (l1, n1)) in enumerate(zip(eager_losses, graph_losses)):
        if cfg.family == "flash":
            assert torch.equal(l0, l1) and torch.equal(n0, n1), (i, float(l0), float(l1), float(n0), float(n1))
        else:
            assert abs(float(l0) - float(l1)) <= 0.01 * abs(float(l0)), (i, float(l0), float(l1))
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        if cfg.family == "flash":
            assert torch.equal(p, q), name


@pytest.mark.cuda
def test_lintime_train_default_captures_packed_documents(tiny_config, tmp_path):
    """With no flags a CUDA run of flash-tiny (documents packing) takes the captured step and says so in one line;
    its losses follow the eager packed steps (rule: 1 % per step, bf16 rounding apart)."""
    cfg = dict(preset="flash-tiny", device="cuda", steps=4, micro_batch_tokens=64, sample_tokens=0)
    lines: list[str] = []
    graph = train(tiny_config(**cfg), out=tmp_path, name="default", progress=False, echo=lines.append)
    eager = train(tiny_config(compile="off", **cfg), out=tmp_path, name="eager", progress=False, echo=None)
    assert any("captured in one CUDA graph (documents" in line for line in lines), lines
    assert not any("does not capture" in line for line in lines), lines
    a, b = ([r["loss"] for r in read_metrics(run.run_dir) if "loss" in r] for run in (graph, eager))
    assert len(a) == len(b) == 4
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= 0.01 * abs(y), (i, a, b)


@pytest.mark.cuda
def test_lintime_train_compile_graph_trains_like_eager_steps(tiny_config, tmp_path):
    """The trainer with the captured step (2 micro-batches, clip, warm-up schedule) against eager steps on the same
    rows.  Rule: 1 % per step.  The two differ by bf16 rounding only (the eager step runs the packed layout and a
    Python-float rate, the graph ``[rows, T]`` and an fp32 rate tensor: ~1e-3 apart), while a wrong replay (a stale
    batch, a lost micro-batch, a rate not written) moves a step's loss by more."""
    cfg = dict(preset="flash-tiny", device="cuda", packing="rows", steps=4, micro_batch_tokens=64, sample_tokens=0)
    lines: list[str] = []
    graph = train(tiny_config(compile="graph", **cfg), out=tmp_path, name="graph", progress=False, echo=lines.append)
    eager = train(tiny_config(compile="off", **cfg), out=tmp_path, name="eager", progress=False, echo=None)
    assert any("captured in one CUDA graph" in line for line in lines), lines
    assert not any("does not capture" in line for line in lines), lines
    a, b = ([r["loss"] for r in read_metrics(run.run_dir) if "loss" in r] for run in (graph, eager))
    assert len(a) == len(b) == 4
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= 0.01 * abs(y), (i, a, b)
