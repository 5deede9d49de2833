"""``lintime export``: a checkpoint as an HF transformers folder (extra ``hf``)."""

from __future__ import annotations

from lintime.cli import CLIError, command


@command
def export(
    checkpoint: str,
    out_dir: str,
    dtype: str = "float32",
    remote_code: bool = True,
    overwrite: bool = False,
) -> None:
    """Write a causal-LM checkpoint as an HF folder: config, safetensors weights, tokenizer.

    The folder loads with transformers' AutoModelForCausalLM / AutoTokenizer / pipeline and
    lm-eval's --model hf (lintime installed: import lintime first; not installed:
    trust_remote_code=True, which uses the lintime sources bundled in the folder).
    See docs/ecosystem.md.

    Args:
        checkpoint: run folder (its latest checkpoint) or a step folder (runs/NAME/checkpoints/step_N).
        out_dir: folder to write (created; must be empty unless --overwrite).
        dtype: weights dtype in the folder: float32, bfloat16 or float16.
        remote_code: also write the trust_remote_code files (lintime sources bundled in the folder).
        overwrite: write into a folder that is not empty.
    """
    try:
        import transformers  # noqa: F401

        from lintime.hf.export import export_checkpoint
    except ImportError as err:
        raise CLIError(f"lintime export needs HF transformers ({err.name} is missing): "
                       f"pip install 'lintime[hf]'") from None
    out = export_checkpoint(checkpoint, out_dir, dtype=dtype, remote_code=remote_code, overwrite=overwrite)
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    print(f"wrote {out}: {', '.join(files)}")
