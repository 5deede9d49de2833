"""``lintime bench``: speed of ops (:func:`lintime.bench.run.run_ops`) and of whole models
(:func:`lintime.bench.model.run_model`) against context length."""

from __future__ import annotations

from lintime.cli import command

# flags that only `bench model` reads, with their defaults (given to `bench ops` they are an error)
_MODEL_FLAGS = {
    "presets": "", "contexts": "", "decode_contexts": "", "tokens_per_batch": 0, "steps": 0, "warmup": 0,
    "decode_steps": 0, "decode_batch": "1", "prefill_chunk": 0, "dtype": "auto", "device": "auto",
    "case_budget_s": 60.0, "parts": "train,decode", "decode_path": "auto", "from_json": "", "plots": True,
}


@command
def bench(
    what: str,
    cases: str = "all",
    out: str = "bench_out",
    quick: bool = False,
    list_cases: bool = False,
    presets: str = "",
    contexts: str = "",
    decode_contexts: str = "",
    tokens_per_batch: int = 0,
    steps: int = 0,
    warmup: int = 0,
    decode_steps: int = 0,
    decode_batch: str = "1",
    prefill_chunk: int = 0,
    dtype: str = "auto",
    device: str = "auto",
    case_budget_s: float = 60.0,
    parts: str = "train,decode",
    decode_path: str = "auto",
    from_json: str = "",
    plots: bool = True,
) -> None:
    """Benchmark ops or whole models against context length: tables, JSON and plots.

    `lintime bench ops`: the attention ops, with other libraries' kernels as anchors when
    installed; writes bench_ops.json (+ bench_ops.png); needs CUDA.  Cases are the case_*
    functions of lintime/bench/cases_<group>.py.

    `lintime bench model`: each family's ~110M causal LM -- training-step time, tokens/s and peak
    memory against T at constant tokens per batch, decoding ms/token, prefill tokens/s and state
    memory against L -- with the anchors HF transformers LlamaForCausalLM (hf:llama-base) and fla
    GLAForCausalLM (fla:gla-base) in the same run when installed; OOM is a row status, not a crash.  Writes bench_model.json, bench_model_train.png,
    bench_model_decode.png.  Runs on CPU too (--quick: every family at tiny size).
    See docs/bench_model.md.

    Args:
        what: ops (attention operations) or model (whole language models).
        cases: ops: comma-separated cases (group.name, or a group for all of its default cases; all = every default case).
        out: output folder.
        quick: ops: fewer context lengths (2k, 8k, 32k); model: a smoke run -- the tiny presets, T and L in 32,64,128, 128 tokens per batch, 2 steps.
        list_cases: print the known cases (ops) or the default presets (model) and exit.
        presets: model: comma-separated presets (default: one ~110M preset per family, then hf:llama-base and fla:gla-base; an anchor is hf:llama-<size> or fla:gla-<size>, sized like transformer-pp-<size> / gla-<size>).
        contexts: model: training contexts T, e.g. 1k,4k,16k (default 1k,2k,...,128k).
        decode_contexts: model: decoding contexts L (default: the training contexts).
        tokens_per_batch: model: tokens per training step; rows = max(1, tokens_per_batch // T) (default 32768).
        steps: model: timed training steps per context (default 5).
        warmup: model: untimed training steps before them (default 2; --quick 1).
        decode_steps: model: timed decoding steps per context (default 16).
        decode_batch: model: sequences decoded together, one or several batch sizes (e.g. 1,64): a row per size.
        prefill_chunk: model: tokens per prefill call when building the decoding state (0 = automatic: the whole prompt up to 32768 tokens per call).
        dtype: model: autocast dtype: auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32.
        device: model: auto, cpu, cuda or cuda:N.
        case_budget_s: model: seconds a case may spend in timed steps; a preset whose median timed step (or timed prefill) exceeds it skips its longer contexts (warm-up time, i.e. compilation and autotuning, is never judged).
        parts: model: train, decode or both (comma-separated).
        decode_path: model: decoding rows per path: eager (a Python call per token), graph (one CUDA-graph replay per token over static state buffers; for hf:llama anchors, HF's static cache + compiled forward), both, or auto (both on CUDA, eager elsewhere).
        from_json: model: measure nothing; merge these bench_model.json files or folders (comma-separated) into --out with tables and plots.
        plots: model: write the PNG plots (needs matplotlib; --no-plots for partial runs merged later).
    """
    given = {k: v for k, v in locals().items() if k in _MODEL_FLAGS and v != _MODEL_FLAGS[k]}
    if what == "ops":
        if given:
            k, v = next(iter(given.items()))
            flag = ("no-" if v is False else "") + k.replace("_", "-")
            raise ValueError(f"--{flag} applies to `lintime bench model`, not ops")
        if list_cases:
            from lintime.bench import discover

            for name, (_, default) in discover().items():
                print(f"{name}{'' if default else '  (not run by default)'}")
            return
        from lintime.bench.run import run_ops

        run_ops(cases, out, quick)
        return
    if what != "model":
        raise ValueError(f"unknown bench target {what!r}; choose: ops, model")
    if cases != "all":
        raise ValueError("--cases applies to `lintime bench ops`; choose models with --presets")
    from lintime.bench import model as bm

    if list_cases:
        for name in bm.QUICK_PRESETS if quick else bm.DEFAULT_PRESETS:
            print(name)
        return
    if from_json:
        from lintime.bench import report

        report.write_outputs(report.merge([p.strip() for p in from_json.split(",") if p.strip()]), out, plots=plots)
        return
    s = bm.make_settings(
        presets=presets, contexts=contexts, decode_contexts=decode_contexts, tokens_per_batch=tokens_per_batch,
        steps=steps, warmup=warmup, decode_steps=decode_steps, decode_batch=decode_batch, prefill_chunk=prefill_chunk,
        dtype=dtype, device=device, quick=quick, case_budget_s=case_budget_s, parts=parts, decode_path=decode_path,
    )
    bm.run_model(s, out, plots=plots)
