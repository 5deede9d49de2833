"""`lintime presets` lists every preset with a parameter count that matches the model."""

import torch

from lintime.cli import main
from lintime.models import CausalLM, get_preset, preset_names


def test_presets_lists_every_family_member_with_its_count(capsys):
    assert main(["presets", "--family", "flash"]) == 0
    out = capsys.readouterr().out
    names = [n for n in preset_names() if get_preset(n).family == "flash"]
    assert names and all(n in out for n in names)
    assert "transformer-tiny" not in out
    n = CausalLM(get_preset("flash-tiny")).num_parameters()
    assert f"{n:,}" in out


def test_unknown_family_is_a_one_line_error(capsys):
    assert main(["presets", "--family", "nope"]) == 2
    assert "unknown family 'nope'" in capsys.readouterr().err
