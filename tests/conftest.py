"""Shared test fixtures and the ``cuda`` marker (skipped without CUDA).

``poison_empty`` (autouse in tests/ops and tests/modules) makes every fresh allocation through ``torch.empty``,
``torch.empty_like`` and ``Tensor.new_empty`` come back filled with NaN (floating dtypes), so
an op that reads memory it never wrote fails its comparison instead of passing by luck
(fla's conftest does the same).
"""

from __future__ import annotations

import os

# One intra-op thread in every process a test starts (CLI runs, subprocess checks, spawned ranks), set before
# torch is imported here so that they all inherit it: a child on PyTorch's default (one thread per core) contends with
# the other xdist worker and with itself; a tiny model's forward + backward ran dozens of times slower that way on a 2-core
# machine (tests/test_without_triton.py's family loop: 10-12 s against 0.2-2 s).  The in-process rule is below.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without CUDA, Triton kernels run in Triton's CPU interpreter.  Triton reads the
# variable when a kernel module is imported, so it is set here, in the root conftest, before any
# test module (models, generation, ...) can import lintime.ops and with it the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_the_interpreter_once() -> None:
    """Triton's interpreter patches ``triton.language`` for a kernel's launch (``_patch_lang``: ``inspect.getmembers``
    over the language modules the kernel's globals name, wrapping every builtin) and undoes it at the launch's end,
    and patches again on every call of a ``@triton.jit`` function inside the kernel (``tl.sum``, ``tl.zeros``, our
    helpers): about a quarter of an interpreted kernel test's time.  Here a launch patches both language modules
    (``triton.language`` and ``triton.language.core``, with Triton's own ``_patch_lang``) and undoes both at its end,
    and a call inside it finds everything it would patch already patched, so it skips the patching.  The kernels run
    the same interpreted code either way.  And its table from Triton's dtypes to NumPy's, built anew on every call of
    ``_get_np_dtype`` (hundreds of thousands a test file), is remembered.  With any other interpreter layout nothing is
    changed, and ``LINTIME_TEST_PLAIN_INTERPRETER=1`` leaves the interpreter as Triton ships it (to rule this out)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # no Triton: the suite's CPU-only paths
        return
    patch, scope_cls = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    if patch is None or scope_cls is None or not callable(getattr(scope_cls, "restore", None)):
        return

    class _BothLanguages:  # what _patch_lang reads of a function: the modules its globals name
        __globals__ = {"tl": tl, "core": tl.core}

    active = [0]  # launches whose patches are in place (launches do not nest; calls inside them do)

    def patch_lang(fn):
        if active[0]:
            return scope_cls()  # a call inside a launch: nothing to patch, nothing to undo
        outer, inner, done = patch(fn), patch(_BothLanguages), [False]
        undo = outer.restore

        def restore():
            inner.restore()
            undo()
            if not done[0]:
                done[0] = True
                active[0] -= 1

        outer.restore = restore
        active[0] += 1
        return outer

    interpreter._patch_lang = patch_lang

    np_dtype, np_dtypes = getattr(interpreter, "_get_np_dtype", None), {}
    if callable(np_dtype):

        def get_np_dtype(tt_dtype):
            try:
                return np_dtypes[tt_dtype]
            except KeyError:
                np_dtypes[tt_dtype] = found = np_dtype(tt_dtype)
                return found
            except TypeError:  # not hashable: ask Triton
                return np_dtype(tt_dtype)

        interpreter._get_np_dtype = get_np_dtype


if os.environ.get("TRITON_INTERPRET") == "1" and not os.environ.get("LINTIME_TEST_PLAIN_INTERPRETER"):
    _patch_the_interpreter_once()

# hypothesis: deterministic, CI-sized
try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "lintime", max_examples=int(os.environ.get("LINTIME_HYPOTHESIS_EXAMPLES", "12")),
        deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow],
    )
    settings.load_profile("lintime")
except ImportError:  # hypothesis is in the `test` extra
    pass


# One intra-op thread per test process: the suites run thousands of tiny ops, where a second
# thread costs more in hand-off than it gains (measured: several-fold slower on the 2-core CI
# machine whenever anything else runs); parallelism comes from pytest-xdist workers instead.
torch.set_num_threads(1)


# Modules holding the suite's longest tests (or a long shared set-up), longest first: they run first.  pytest-xdist's
# ``load`` schedule hands out tests in collection order, so a long test near the end of the order keeps one worker
# busy while the other has nothing left; at the front it overlaps with the short tests.  Whole modules move, in their
# own order, so a module-scoped fixture is still set up once per worker.  The many short kernel tests of tests/ops
# already sit mid-order and stay there: what must not come last is a long one.
SLOW_MODULES = (
    "tests/distributed/test_distributed.py",
    "tests/cli/test_mqar_cli.py",
    "tests/distributed/test_fsdp_compiled_step.py",
    "tests/distributed/test_ddp_graph_step.py",  # next to the one above: they share one launch (a session fixture)
    "tests/test_without_triton.py",
    "tests/quality/test_quality_mqar.py",
    "tests/ops/gau/test_gau.py",
    "tests/serving/test_serve_bench.py",
    "tests/test_imports.py",
    "tests/serving/test_server.py",
    "tests/hf/test_hf_model.py",
    "tests/bench/test_recall_sweep.py",
    "tests/cli/test_new_user.py",
    "tests/training/test_tasks_graph.py",
    "tests/evaluation/test_mqar_mix.py",
    "tests/bench/test_train_default.py",
    "tests/training/test_compiled_model.py",
    "tests/quality/test_quality_retrieval_ft.py",
    "tests/cli/test_eval_tasks_cli.py",
    "tests/quality/test_quality_bpe.py",
)


def _slow_rank(item) -> int:
    path = item.nodeid.split("::", 1)[0]
    try:
        return SLOW_MODULES.index(path)
    except ValueError:
        return len(SLOW_MODULES)


def pytest_collection_modifyitems(config, items):
    """The modules of :data:`SLOW_MODULES` first (a stable sort: every other test keeps its place), and
    ``@pytest.mark.cuda`` means "needs a CUDA device": such tests are skipped without one."""
    items[:] = sorted(items, key=_slow_rank)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _one_thread():
    """Every test starts on one intra-op thread, whatever the test before it set."""
    torch.set_num_threads(1)
    yield


def _poisoned(fn):
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            out.fill_(float("nan"))
        return out

    return wrapper


@pytest.fixture
def poison_empty(monkeypatch):
    monkeypatch.setattr(torch, "empty", _poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _poisoned(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", _poisoned(torch.Tensor.new_empty))
    yield


@pytest.fixture
def impl_calls(monkeypatch):
    """``impl_calls(family_module, backend)``: wrap that family's registered implementation so every
    call is counted; returns the list the calls are appended to (the dispatch tests assert on it)."""

    def spy(module, backend):
        calls = []
        impl = module._IMPLS[backend]
        monkeypatch.setitem(module._IMPLS, backend, lambda *a, **kw: calls.append(1) or impl(*a, **kw))
        return calls

    return spy


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
