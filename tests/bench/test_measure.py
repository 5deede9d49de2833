"""lintime.bench.measure's environment record: the commit override and the host description."""

from lintime.bench import measure


def test_git_commit_override(monkeypatch):
    monkeypatch.setenv("LINTIME_GIT_COMMIT", "0123abc")
    assert measure.git_commit() == "0123abc"
    monkeypatch.delenv("LINTIME_GIT_COMMIT")
    sha = measure.git_commit()  # the checkout's own (None outside git)
    assert sha is None or len(sha.removesuffix("+dirty")) == 40


def test_cpu_model_is_named():
    name = measure._cpu_model()
    assert isinstance(name, str) and name.strip()
