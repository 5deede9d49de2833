"""Issue 43 item 3: the multi-key needle (benchmarks/quality/retrieval.py) on a toy with stub
decoders, the time guard, and report.py's retrieval table on synthetic run records.

Expected values are worked out here from the trials' own data (which pair is asked, its value) or
by hand from the typed-in accuracies, not copied from the code's output."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest

QUALITY = Path(__file__).resolve().parents[2] / "benchmarks" / "quality"
sys.path.insert(0, str(QUALITY))

torch = pytest.importorskip("torch")

import report as rep  # noqa: E402
import retrieval as rt  # noqa: E402
import run as study  # noqa: E402
from lintime.data.tokenizer import ByteTokenizer  # noqa: E402
from lintime.evaluation.tasks.passkey import FillerStream  # noqa: E402

TOK = ByteTokenizer()
DOCS = [f"def f{i}(x):\n    return x * {i}  # filler line {i}\n" * 3 for i in range(20)]
ASK_RE = re.compile(r"What is the value of key ([a-z]{6})\? The value of key \1 is $")


def _pairs_in(text: str) -> dict[str, str]:
    return dict(re.findall(r"# The value of key ([a-z]{6}) is (\d{5})\.", text))


def _stub(answer):
    """A decoder that reads each prompt as text and answers ``answer(pairs, asked_name)``."""
    def decode(model, rows, n):
        out = []
        for row in rows.tolist():
            text = TOK.decode(row[1:])
            name = ASK_RE.search(text).group(1)
            out.append(TOK.encode(answer(_pairs_in(text), name))[:n])
        return out
    return decode


class _Model:  # no config: not a softmax model; eval/train are no-ops
    training = False

    def eval(self):
        return self

    def train(self, mode=True):
        return self


def test_needle_prompt_has_the_length_the_pairs_and_the_asked_one_at_its_depth():
    stream = FillerStream(DOCS, TOK)
    for depth in (0.0, 0.5, 1.0):
        pairs, asked, rng = rt.needle_trial(3, 512, depth, 0)
        assert len({n for n, _ in pairs}) == rt.N_KEYS and len({v for _, v in pairs}) == rt.N_KEYS
        ids = rt.make_needle_prompt(stream, TOK, 512, depth, pairs, asked, rng)
        assert len(ids) == 512 and ids[0] == TOK.bos_id
        text = TOK.decode(ids[1:])
        assert _pairs_in(text) == dict(pairs)
        assert ASK_RE.search(text).group(1) == pairs[asked][0]
        where = text.index(rt.PAIR.format(name=pairs[asked][0], value=pairs[asked][1]))
        if depth == 0.0:
            assert where == 0
        if depth == 1.0:  # right before the question
            assert text[where:].startswith(rt.PAIR.format(name=pairs[asked][0], value=pairs[asked][1]) + rt.ASK[:5])
    # seeded: the same trial twice is the same prompt
    a = rt.make_needle_prompt(stream, TOK, 300, 0.25, *rt.needle_trial(1, 300, 0.25, 4))
    b = rt.make_needle_prompt(stream, TOK, 300, 0.25, *rt.needle_trial(1, 300, 0.25, 4))
    assert a == b


def test_needle_scores_a_right_a_wrong_and_a_distracted_stub():
    stream = FillerStream(DOCS, TOK)
    depths = (0.0, 0.5, 1.0)
    kw = dict(trials=4, batch_size=3, depths=depths)
    right = rt.evaluate_needle(_Model(), TOK, stream, 400, decode=_stub(lambda p, n: p[n]), **kw)
    assert [c["accuracy"] for c in right] == [1.0] * 3 and all(c["distractor"] == 0 for c in right)
    wrong = rt.evaluate_needle(_Model(), TOK, stream, 400, decode=_stub(lambda p, n: "00000"), **kw)
    assert [c["correct"] for c in wrong] == [0, 0, 0] and all(c["distractor"] == 0 for c in wrong)
    # the value of the alphabetically first name: right exactly when the asked name is that one
    first = rt.evaluate_needle(_Model(), TOK, stream, 400, decode=_stub(lambda p, n: p[min(p)]), **kw)
    for c, depth in zip(first, depths):
        asked_first = [min(n for n, _ in pairs) == pairs[asked][0]
                       for pairs, asked, _ in (rt.needle_trial(0, 400, depth, t) for t in range(4))]
        assert c["correct"] == sum(asked_first)
        assert c["distractor"] == 4 - sum(asked_first)
        assert c["accuracy"] == pytest.approx(sum(asked_first) / 4)


def test_measure_marks_what_does_not_fit_the_deadline_as_not_run():
    now = [0.0]

    def decode(model, rows, n):  # every decoding call "takes" 10 s
        now[0] += 10.0
        return _stub(lambda p, name: p[name])(model, rows, n)

    import tempfile

    with tempfile.TemporaryDirectory() as d:  # measure reads its filler from a corpus folder's test split
        for i, doc in enumerate(DOCS * 10):
            (Path(d) / f"doc{i}.py").write_text(doc)
        out = rt.measure(_Model(), TOK, 256, corpus=d, deadline=25.0, trials=1, depths=(0.0, 1.0), tasks=("needle",),
                         clock=lambda: now[0], decode=decode)
    cells = {c["multiple"]: c for c in out["cells"]}
    assert cells[1]["status"] == "done" and cells[1]["accuracy"] == 1.0 and cells[1]["trials"] == 2
    # 2x: ~10 s x 2 x 1.3 = 26 s > 15 s left; 4x: 52 s
    assert cells[2]["status"] == "not run" and "left" in cells[2]["why"]
    assert cells[4]["status"] == "not run"
    assert rt.accuracy(out, "needle", 1) == 1.0 and rt.accuracy(out, "needle", 2) is None
    assert rt.accuracy(out, "passkey", 1) is None
    assert rt.needle_min_len(TOK) > 128  # the smoke's 128 is too short for 4 pairs: recorded, not failed
    short = rt.measure(_Model(), TOK, 128, corpus="unused", deadline=1e9, multiples=(1,), tasks=("needle",),
                       decode=decode)
    assert short["cells"][0]["status"] == "not run" and "shorter" in short["cells"][0]["why"]


def _retrieval(acc: dict[tuple[str, int], float | None], context: int) -> dict:
    cells = []
    for (task, m), a in acc.items():
        if a is None:
            cells.append({"task": task, "multiple": m, "context_len": context * m, "status": "not run",
                          "why": "needs ~90 s, 12 s left"})
        else:
            cells.append({"task": task, "multiple": m, "context_len": context * m, "status": "done", "trials": 50,
                          "correct": round(a * 50), "accuracy": a})
    return {"cells": cells}


def _record(run, acc, ft=None):
    """A finished run; ``acc``: its as-trained accuracies, ``ft``: after the retrieval fine-tune (None: no
    ``retrieval_ft`` block, a string: a fine-tune recorded "not run" with that reason)."""
    rec = {"id": run.id, "status": "done", "run": dataclasses.asdict(run), "gpus": 1, "commit": "abc1234",
           "lr": 1e-3, "tokens": run.tokens, "val_curve": [{"step": 1, "tokens": 1, "time_s": 1.0, "bpb": 1.0}],
           "timing": {"one_off_s": 0.0, "train_s": 1.0}, "final": {"validation_bpb": 1.0, "test_bpb": 1.0},
           "retrieval": _retrieval(acc, run.context)}
    if isinstance(ft, str):
        rec["retrieval_ft"] = study.ft_not_run(run, 1e-3, ft)
    elif ft is not None:
        rec["retrieval_ft"] = {"status": "done", "retrieval": _retrieval(ft, run.context)}
    return rec


def _write_runs(tmp_path, anchor_accs, as_trained=(0.10, 0.20, 0.30)):
    """Transformer++ at 1024: ``anchor_accs`` = each seed's passkey 1x after the fine-tune, ``as_trained`` before."""
    plan = study.plan()
    runs = {(r.family, r.context, r.seed): r for r in plan if r.kind == "study"}
    for seed, a in enumerate(anchor_accs):
        r = runs[("transformer-pp", 1024, seed)]
        (tmp_path / f"{r.id}.json").write_text(json.dumps(_record(
            r, {("passkey", 1): as_trained[seed], ("passkey", 2): 0.5, ("passkey", 4): None, ("needle", 1): 0.8},
            ft={("passkey", 1): a, ("passkey", 2): 0.7, ("needle", 1): 0.84})))
    r = runs[("flash", 1024, 0)]
    (tmp_path / f"{r.id}.json").write_text(json.dumps(_record(
        r, {("passkey", 1): 0.42, ("needle", 4): 0.06}, ft="needs ~150 s (documents_s 15), 40 s left")))
    return plan


def test_retrieval_table_cells_and_readability(tmp_path):
    plan = _write_runs(tmp_path, [0.96, 0.92, 0.90])
    tab = rep.retrieval_table(rep.load(tmp_path, plan), plan)
    tpp, fl = tab["rows"][1024]["transformer-pp"]["as trained"], tab["rows"][1024]["flash"]["as trained"]
    assert tpp[("passkey", 1)]["acc"] == [0.10, 0.20, 0.30]
    assert rep.retrieval_cell_text(tpp[("passkey", 1)]) == "20% (min 10%) (3 seeds)"
    assert rep.retrieval_cell_text(tpp[("passkey", 2)]) == "50% (3 seeds)"
    assert rep.retrieval_cell_text(tpp[("passkey", 4)]) == "not run" and "12 s left" in tpp[("passkey", 4)]["why"]
    assert rep.retrieval_cell_text(tpp[("needle", 2)]) == "not run"
    assert rep.retrieval_cell_text(fl[("passkey", 1)]) == "42%" and rep.retrieval_cell_text(fl[("needle", 4)]) == "6%"
    assert rep.retrieval_cell_text(tab["rows"][1024]["gla"]["as trained"][("passkey", 1)]) == "not run"
    ft, fl_ft = tab["rows"][1024]["transformer-pp"]["fine-tuned"], tab["rows"][1024]["flash"]["fine-tuned"]
    assert ft[("passkey", 1)]["acc"] == [0.96, 0.92, 0.90]
    assert rep.retrieval_cell_text(ft[("passkey", 1)]) == "93% (min 90%) (3 seeds)"  # (0.96+0.92+0.90)/3 = 0.9267
    assert rep.retrieval_cell_text(ft[("passkey", 2)]) == "70% (3 seeds)"
    # FLASH's fine-tune did not fit: every fine-tuned cell says so, its as-trained ones stand
    assert all(rep.retrieval_cell_text(c) == "not run" for c in fl_ft.values())
    assert "40 s left" in fl_ft[("passkey", 1)]["why"] and "fine-tune not run" in fl_ft[("passkey", 1)]["why"]
    # 1024: every anchor seed >= 90 % after the fine-tune: readable (as trained it is not: 10-30 %);
    # the other contexts have no anchor run: not readable
    assert tab["readable"][1024][0] is True and tab["as_trained_pass"][1024][0] is False
    assert all(not ok for ctx, (ok, _) in tab["readable"].items() if ctx != 1024)
    assert tab["all_readable"] is False
    md = rep.retrieval_markdown(tab)
    assert "**Table: not readable**" in md and "4096: Transformer++'s passkey at 1x (fine-tuned): not run" in md
    assert "judged on the fine-tuned rows" in md and "As trained, Transformer++ passes the bar at: no context" in md
    assert f"{study.RETRIEVAL_FT_STEPS} steps" in md and f"{study.RETRIEVAL_FT_MIX:.0%} synthetic" in md
    head = next(ln for ln in md.splitlines() if ln.startswith("| context |"))
    assert head.startswith("| context | family | model | passkey 1x |")
    both = [ln for ln in md.splitlines() if ln.startswith("| 1024 | Transformer++ |")]
    assert len(both) == 2 and both[0].startswith("| 1024 | Transformer++ | as trained | 20% (min 10%) (3 seeds) |")
    assert both[0].endswith("| - |")  # the bar is not applied to the as-trained row
    assert both[1].startswith("| 1024 | Transformer++ | fine-tuned | 93% (min 90%) (3 seeds) |")
    assert both[1].endswith("| yes |")
    assert "90%" in md and "inside its trained context" in md


def test_one_anchor_seed_below_the_bar_makes_its_context_not_readable(tmp_path):
    # fine-tuned: mean 95 %, but one seed at 88 %; as trained every seed passes: the bar is the fine-tuned one
    plan = _write_runs(tmp_path, [0.98, 0.88, 0.99], as_trained=(0.95, 0.95, 0.95))
    tab = rep.retrieval_table(rep.load(tmp_path, plan), plan)
    ok, why = tab["readable"][1024]
    assert ok is False and "88%" in why and "fine-tuned" in why
    assert tab["as_trained_pass"][1024][0] is True
    md = rep.retrieval_markdown(tab)
    assert "As trained, Transformer++ passes the bar at: 1024." in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| 1024 | FLASH |")]
    assert rows[0].endswith("| - |") and rows[1].endswith("| not readable |")


def test_the_whole_table_is_readable_when_every_context_anchor_passes(tmp_path):
    plan = [r for r in study.plan() if r.context == 1024]
    runs = {(r.family, r.seed): r for r in plan if r.kind == "study"}
    for seed in (0, 1, 2):
        r = runs[("transformer-pp", seed)]
        (tmp_path / f"{r.id}.json").write_text(json.dumps(_record(r, {("passkey", 1): 1.0}, ft={("passkey", 1): 1.0})))
    tab = rep.retrieval_table(rep.load(tmp_path, plan), plan)
    assert tab["all_readable"] is True
    assert "**Table: readable**" in rep.retrieval_markdown(tab)
    # one seed without its fine-tune: that context is not readable, whatever the as-trained model does
    r = runs[("transformer-pp", 2)]
    (tmp_path / f"{r.id}.json").write_text(json.dumps(_record(r, {("passkey", 1): 1.0}, ft="--no-retrieval-ft")))
    tab = rep.retrieval_table(rep.load(tmp_path, plan), plan)
    assert tab["all_readable"] is False and "2 of 3 seeds" in tab["readable"][1024][1]


def test_no_retrieval_records_every_cell_not_run():
    nr = rt.not_run(2048, "--no-retrieval")
    assert {(c["task"], c["multiple"], c["context_len"]) for c in nr["cells"]} == {
        (t, m, 2048 * m) for t in ("passkey", "needle") for m in (1, 2, 4)}
    assert all(rt.accuracy(nr, t, m) is None for t in ("passkey", "needle") for m in (1, 2, 4))
