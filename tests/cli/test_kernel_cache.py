"""The first-start notice of `lintime generate` / `lintime serve` on a GPU (lintime/utils/kernel_cache.py): shown until
a run of that command finished on that GPU model with this lintime / torch / Triton, then not; per command and per GPU
model; a cache folder that cannot be written only means the notice shows again."""

from __future__ import annotations

import pytest

from lintime.utils.kernel_cache import first_start_notice, record_start


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LINTIME_CACHE", str(tmp_path))
    return tmp_path


def test_notice_until_a_run_finished_per_command_and_gpu(cache):
    line = first_start_notice("generate", "NVIDIA H200")
    assert line is not None and "NVIDIA H200" in line and "compiles" in line and "\n" not in line
    record_start("generate", "NVIDIA H200")
    assert first_start_notice("generate", "NVIDIA H200") is None
    assert first_start_notice("serve", "NVIDIA H200") is not None  # another command runs other kernels
    assert first_start_notice("generate", "NVIDIA A100-SXM4-80GB") is not None  # another GPU model
    assert [p.parent.name for p in cache.rglob("*.done")] == ["kernels"]


def test_unwritable_cache_only_keeps_the_notice(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("LINTIME_CACHE", str(blocker / "cache"))  # under a file: no folder can be made, even as root
    record_start("generate", "NVIDIA H200")  # no exception
    assert first_start_notice("generate", "NVIDIA H200") is not None
