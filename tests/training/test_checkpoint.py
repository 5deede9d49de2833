"""The run-folder / checkpoint contract: atomic step folders, ``latest``, keep-last-N, load_model."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lintime.data import ByteTokenizer
from lintime.models import CausalLM, MaskedLM, get_preset
from lintime.training import checkpoint as ckpt
from lintime.training import (
    list_checkpoints,
    load_model,
    load_trainer_state,
    resolve_checkpoint,
    save_checkpoint,
)


def _run(tmp_path, objective="clm"):
    cfg = get_preset("transformer-pp-tiny", vocab_size=260)
    model = (CausalLM if objective == "clm" else MaskedLM)(cfg)
    run = tmp_path / "run"
    ckpt.write_run_config(run, model_config=cfg, objective=objective, tokenizer=ByteTokenizer(), train={"seed": 0})
    return run, model


def _state(step):
    return {"step": step, "rng": torch.get_rng_state(), "nested": {"x": [1, 2.5, "a"], "t": torch.arange(3)}}


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(model, weights):
    return all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_layout_and_round_trip(tmp_path):
    run, model = _run(tmp_path)
    step_dir = save_checkpoint(run, 100, model, _state(100))
    assert step_dir == run / "checkpoints" / "step_00000100"
    assert sorted(p.name for p in step_dir.iterdir()) == ["checksums.json", "model.safetensors", "trainer_state.pt"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000100"
    config = json.loads((run / "config.json").read_text())
    assert set(config) == {"model", "objective", "tokenizer", "train", "lintime_version"}
    assert config["tokenizer"] == "byte" and config["objective"] == "clm"
    # trainer state: plain containers and tensors, readable with weights_only=True
    state = torch.load(step_dir / "trainer_state.pt", weights_only=True)
    assert state["step"] == 100 and torch.equal(state["nested"]["t"], torch.arange(3))
    for path in (run, step_dir):
        loaded = load_model(path)
        assert loaded.step == 100 and isinstance(loaded.model, CausalLM) and not loaded.model.training
        assert loaded.tokenizer == ByteTokenizer() and loaded.config == config
        assert _same(loaded.model, _weights(model))


def test_masked_lm_round_trip(tmp_path):
    run, model = _run(tmp_path, "mlm")
    save_checkpoint(run, 1, model, _state(1))
    assert isinstance(load_model(run).model, MaskedLM)


def test_keep_last_n(tmp_path):
    run, model = _run(tmp_path)
    for step in range(1, 6):
        save_checkpoint(run, step, model, _state(step), keep=2)
    assert [p.name for p in list_checkpoints(run)] == ["step_00000004", "step_00000005"]
    for step in range(6, 9):
        save_checkpoint(run, step, model, _state(step), keep=0)  # 0 keeps everything
    assert len(list_checkpoints(run)) == 5
    assert resolve_checkpoint(run).name == "step_00000008"


def test_crash_mid_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    run, model = _run(tmp_path)
    save_checkpoint(run, 1, model, _state(1))
    before = _weights(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def torn_save(obj, f, *args, **kwargs):  # half the file, then the disk fills up
        f.write(b"\x80\x02partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", torn_save)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint(run, 2, model, _state(2))
    monkeypatch.undo()
    names = sorted(os.listdir(run / "checkpoints"))
    assert names == ["latest", "step_00000001"]  # no partial step folder, no temporary left
    loaded = load_model(run)
    assert loaded.step == 1 and _same(loaded.model, before)


def test_leftovers_of_a_killed_save_are_ignored_then_removed(tmp_path):
    run, model = _run(tmp_path)
    save_checkpoint(run, 1, model, _state(1))
    # a process killed mid-save leaves a hidden temporary folder with a truncated file
    torn = run / "checkpoints" / ".tmp-step_00000002-abc123"
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"\x00" * 10)
    assert [p.name for p in list_checkpoints(run)] == ["step_00000001"]
    assert load_model(run).step == 1
    save_checkpoint(run, 2, model, _state(2))
    assert not torn.exists()


def test_crash_before_latest_moves_still_loads_a_complete_checkpoint(tmp_path, monkeypatch):
    run, model = _run(tmp_path)
    save_checkpoint(run, 1, model, _state(1))

    def fail(path, text):
        raise OSError("killed")

    monkeypatch.setattr(ckpt, "atomic_write_text", fail)
    with pytest.raises(OSError):
        save_checkpoint(run, 2, model, _state(2))
    monkeypatch.undo()
    # latest still names step 1, which is complete; step 2 is complete too and listed
    assert load_model(run).step == 1
    assert [p.name for p in list_checkpoints(run)] == ["step_00000001", "step_00000002"]


def test_resaving_a_step_replaces_it(tmp_path):
    run, model = _run(tmp_path)
    save_checkpoint(run, 3, model, _state(3))
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    save_checkpoint(run, 3, model, _state(3))
    assert _same(load_model(run).model, _weights(model))
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_00000003"]


def test_load_errors_are_one_line(tmp_path):
    run, model = _run(tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint yet"):
        load_model(run)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="neither a run folder"):
        load_model(tmp_path)
    save_checkpoint(run, 1, model, _state(1))
    # a config that does not match the weights
    config = json.loads((run / "config.json").read_text())
    config["model"]["d_model"] = 32
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not fit this model") as err:
        load_model(run)
    assert "\n" not in str(err.value)
    config["model"]["family"] = "no_such_family"
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="cannot be built") as err:
        load_model(run)
    assert "\n" not in str(err.value)
    (run / "checkpoints" / "step_00000001" / "trainer_state.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="corrupted: trainer_state.pt does not match the checksum"):
        load_trainer_state(run / "checkpoints" / "step_00000001")
    (run / "checkpoints" / "step_00000001" / "checksums.json").unlink()  # a checkpoint saved without checksums
    with pytest.raises(ValueError, match="unreadable"):
        load_trainer_state(run / "checkpoints" / "step_00000001")
