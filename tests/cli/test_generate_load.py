"""Loading a checkpoint for ``lintime generate`` (:func:`lintime.training.checkpoint.load_model`): the finite-values
check names exactly the tensors that hold NaN or infinity, and the checksum comparison, which runs while the model is
built, still refuses a corrupted file, after a missing one is reported as missing."""

from __future__ import annotations

import pytest
import torch

from lintime.cli import main
from lintime.data import ByteTokenizer
from lintime.models import CausalLM, get_preset
from lintime.training.checkpoint import WEIGHTS_FILE, load_model, nonfinite_tensors
from tiny_presets import saved_preset_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return saved_preset_run(tmp_path_factory.mktemp("load") / "run", "flash-tiny")


class _Mixed(torch.nn.Module):
    """Floating-point tensors of several dtypes and sizes, an empty one and an integer buffer."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(3, 5))
        self.b = torch.nn.Parameter(torch.randn(1))
        self.c = torch.nn.Parameter(torch.randn(4099).to(torch.bfloat16))
        self.d = torch.nn.Parameter(torch.randn(2, 700, dtype=torch.float64))
        self.empty = torch.nn.Parameter(torch.randn(0, 4))
        self.register_buffer("count", torch.arange(6))


def _reference(model: torch.nn.Module) -> list[str]:
    return [n for n, t in model.state_dict().items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_nonfinite_tensors_names_the_tensors_with_nan_or_infinity(value, where):
    torch.manual_seed(0)
    model = _Mixed()
    assert nonfinite_tensors(model) == [] == _reference(model)
    with torch.no_grad():
        for name in ("a", "c", "d"):
            flat = getattr(model, name).view(-1)
            flat[{"first": 0, "middle": flat.numel() // 2, "last": -1}[where]] = value
    assert nonfinite_tensors(model) == ["a", "c", "d"] == _reference(model)


def test_a_large_finite_double_is_finite():
    model = _Mixed()
    with torch.no_grad():
        model.d.fill_(1e300)
    assert nonfinite_tensors(model) == []


def test_load_model_gives_the_saved_weights(run_dir):
    loaded = load_model(run_dir)
    torch.manual_seed(0)
    saved = CausalLM(get_preset("flash-tiny", vocab_size=ByteTokenizer().vocab_size))
    for name, t in saved.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], t), name
    assert not loaded.model.training and loaded.step == 1


def test_a_changed_weights_file_is_refused_as_corrupted(run_dir, tmp_path, capsys):
    import shutil

    run = shutil.copytree(run_dir, tmp_path / "run")
    weights = next((run / "checkpoints").glob("step_*")) / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[-5:] = bytes(b ^ 0xFF for b in data[-5:])
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupted"):
        load_model(run)
    assert main(["generate", str(run), "--max-new-tokens", "2"]) == 2
    assert "corrupted" in capsys.readouterr().err
    weights.unlink()  # the missing file is named, not the checksum comparison's failure
    with pytest.raises(FileNotFoundError, match=WEIGHTS_FILE):
        load_model(weights.parent)
