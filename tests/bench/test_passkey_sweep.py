"""benchmarks/passkey_sweep.py on the CPU: run folders found, lengths outermost with the
deadline cutting the longest, a failing model recorded, the JSON / table / plot of a real tiny run."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import passkey_sweep as ps  # noqa: E402

from lintime.data import ByteTokenizer  # noqa: E402
from lintime.evaluation.tasks import passkey as passkey_mod  # noqa: E402
from lintime.models import CausalLM, get_preset  # noqa: E402
from lintime.training.checkpoint import save_checkpoint, write_run_config  # noqa: E402


def _run(root: Path, name: str, checkpoint: bool = True) -> Path:
    tok = ByteTokenizer()
    torch.manual_seed(0)
    model = CausalLM(get_preset("gla-tiny", vocab_size=tok.vocab_size))
    run = root / name
    write_run_config(run, model_config=model.config, objective="clm", tokenizer=tok, train={"context_len": 64})
    if checkpoint:
        save_checkpoint(run, 5, model, {"step": 5})
    return run


def test_find_runs(tmp_path):
    a, b = _run(tmp_path / "work", "b-run"), _run(tmp_path / "work", "a-run", checkpoint=False)
    (tmp_path / "work" / "logs").mkdir()
    assert ps.find_runs([str(tmp_path / "work")]) == [b, a]  # sorted, non-runs left out
    assert ps.find_runs([str(a)]) == [a]
    with pytest.raises(SystemExit, match="neither a run folder"):
        ps.find_runs([str(tmp_path / "work" / "logs")])
    assert ps._parse_lengths("1k,2048,32k") == [1024, 2048, 32768]


def test_lengths_outermost_deadline_and_a_failing_model(monkeypatch):
    """Each evaluation takes 10 s of a fake clock; the deadline at 25 s lets three through: both
    models at 1k, then the first at 2k; a model that fails is recorded and not run again."""
    now = [0.0]
    calls, sizes = [], []

    def fake(model, tokenizer, lens, depths, **kw):
        (L,) = lens
        calls.append((model, L))
        sizes.append(kw["batch_size"])
        now[0] += 10.0
        if model == "bad":
            raise RuntimeError("CUDA out of memory")
        cells = [passkey_mod.PasskeyCell(L, d, kw["trials"], 1, 1 / kw["trials"], 0.1) for d in depths]
        return passkey_mod.PasskeyReport(digits=5, seed=0, filler="x", cells=cells)

    monkeypatch.setattr(passkey_mod, "evaluate_passkey", fake)
    models = [{"name": "m1"}, {"name": "m2"}, {"name": "m3"}]
    loaded = {n: types.SimpleNamespace(model=m, tokenizer=None) for n, m in (("m1", "good"), ("m2", "bad"), ("m3", "good"))}
    ps.sweep(models, loaded, [1024, 2048, 4096], [0.0, 1.0], trials=4, digits=5, seed=0, batch_size=4, chunk_size=64,
             autocast=None, deadline=35.0, batch_tokens=4096, say=lambda line: None, clock=lambda: now[0])
    assert [(m, L) for m, L in calls] == [("good", 1024), ("bad", 1024), ("good", 1024), ("good", 2048)]
    assert sizes == [4, 4, 4, 2]  # 4 prompts, at most 4096 tokens a batch: 2 prompts of 2048
    m1, m2, m3 = models
    assert "CUDA out of memory" in m2["error"] and m2["cells"] == []
    assert m1["not_run"] == [4096] and m3["not_run"] == [2048, 4096]
    assert ps.mean_by_length(m1) == {1024: 0.25, 2048: 0.25}
    data = {"settings": {"lengths": [1024, 2048, 4096]}, "models": models}
    assert ps.table(data).splitlines()[2:] == ["| m1 | ? | 0.25 | 0.25 | not run |", "| m2 | ? | failed | failed | failed |",
                                               "| m3 | ? | 0.25 | not run | not run |"]


def test_rows_per_batch():
    assert [ps.rows_per_batch(L, 40, 8000) for L in (100, 1000, 3000, 9000)] == [40, 8, 2, 1]
    assert ps.rows_per_batch(9000, 40, 0) == 40


def test_tiny_sweep_writes_json_table_and_plot(tmp_path, capsys):
    _run(tmp_path / "work", "gla-a")
    _run(tmp_path / "work", "gla-none", checkpoint=False)
    out = tmp_path / "pk"
    assert ps.main([str(tmp_path / "work"), "--tiny", "--out", str(out)]) == 1  # one run has no checkpoint
    data = json.loads((out / "passkey_sweep.json").read_text())
    good, bad = data["models"]
    assert good["name"] == "gla-a" and good["family"] == "gla" and good["trained_context"] == 64
    assert sorted((c["context_len"], c["depth"]) for c in good["cells"]) == [(128, 0.0), (128, 1.0), (256, 0.0), (256, 1.0)]
    assert all(c["trials"] == 2 and len(c["answers"]) == 2 for c in good["cells"])
    assert "no checkpoint" in bad["error"]
    assert data["settings"]["lengths"] == [128, 256] and data["device"]
    table = (out / "passkey_sweep.md").read_text()
    assert "| gla-a | 64 |" in table and "| gla-none | ? | failed | failed |" in table
    assert (out / "passkey_sweep.png").stat().st_size > 1000
