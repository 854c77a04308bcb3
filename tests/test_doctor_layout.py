"""eyas doctor's layout checks on the tiny pair (tests/doctor_pair.py): a draft relabelled with shifted or wrong
ids, with the embedding included or the final state only, is named and the true layout ranked first; the
unpaired accuracy test's spread, ties going to the simplest explanation, and the candidates covering the
brief."""

from __future__ import annotations

import torch

from eyas.doctor.checks import run_doctor
from eyas.draft import load_draft
from eyas.probe import LayoutRanking, infer_layout, layout_candidates
from tests.doctor_pair import (
    LAYOUT,
    edit_json,
    relabel,
)

# ---- layout faults: the doctor measures which layout the draft really reads -------------------------

def test_shifted_ids_are_found_and_the_true_layout_ranked_first(pair, tmp_path):
    d = relabel(pair, tmp_path / "shifted", [3, 5, 6])  # every id +1: the SGLang/vLLM off-by-one
    rep = run_doctor(pair.target, load_draft(d), samples=pair.samples())
    c = rep.check("layout")
    assert c.status == "fail", c.summary
    assert rep.layout.best.indices == LAYOUT
    assert "recorded shifted -1" in rep.layout.best.label
    assert "[2, 4, 5]" in c.summary and "[3, 5, 6]" in c.summary
    assert c.numbers["diff_points"] > 5
    assert "--aux-indices 2,4,5" in c.fix
    assert rep.exit_code == 1


def test_wrong_ids_are_found(pair, tmp_path):
    d = relabel(pair, tmp_path / "wrong", [1, 3, 7])
    rep = run_doctor(pair.target, load_draft(d), samples=pair.samples())
    c = rep.check("layout")
    assert c.status == "fail" and rep.layout.best.indices == LAYOUT, (c.summary, rep.layout[:3])
    assert c.numbers["recorded_acc"] < c.numbers["best_acc"] - 0.05


def test_embedding_included_is_found(pair, tmp_path):
    # the story's misreading: cat([embed, low, mid]) where the draft was trained on cat([low, mid, high])
    d = relabel(pair, tmp_path / "embed", [0, 2, 4])
    rep = run_doctor(pair.target, load_draft(d), samples=pair.samples())
    c = rep.check("layout")
    assert c.status == "fail" and rep.layout.best.indices == LAYOUT, (c.summary, rep.layout[:3])
    assert "embedding" in c.summary


def test_final_state_only_is_named(pair, tmp_path):
    # config.json turns aux capture off: SGLang and vLLM then feed the 1xH final state, skipping fc
    d = pair.copy(tmp_path / "final")
    edit_json(d / "config.json", lambda c: c["eagle_config"].update(use_aux_hidden_state=False))
    rep = run_doctor(pair.target, load_draft(d), samples=pair.samples())
    c = rep.check("config_ids")
    assert c.status == "fail" and "final state only" in c.summary, c.summary
    final = next(s for s in rep.layout if s.indices == [])
    assert "EAGLE instead of EAGLE3" in final.label
    assert final.accuracy < rep.layout.find(LAYOUT).accuracy - 0.2  # measured: the draft is useless on it
    assert rep.check("layout").status == "pass"  # the draft itself still reads its recorded layout


def test_infer_layout_api(pair):
    d = load_draft(pair.draft_dir)
    r = infer_layout(pair.target, d.model, pair.samples()[:40], recorded=[3, 5, 6])
    assert isinstance(r, LayoutRanking) and r.best.indices == LAYOUT
    idx, label, acc, loss = r[0]  # (indices, label, accuracy, loss) tuples, ranked by held-out loss
    assert idx == LAYOUT and 0 < acc <= 1 and label and loss > 0
    assert all(s.loss >= loss for s in r if s.indices)
    worse, diff, se = r.worse([3, 5, 6], LAYOUT)  # the shifted reading is worse beyond noise, paired
    assert worse and diff > 4 * se > 0
    assert r["aux_indices"] == LAYOUT and r.get("chosen") == label and r.tokens > 0
    # explicit candidates (the import path): exactly those are ranked
    r2 = infer_layout(pair.target, d.model, pair.samples()[:40], {"sglang reading": [3, 5, 6], "vllm reading": LAYOUT})
    assert [s.indices for s in r2] == [LAYOUT, [3, 5, 6]]
    assert r2["chosen"].startswith("vllm reading")


def _unpaired(per: list[tuple[int, int]], metric: float = 0.40, rows: int = 20000):
    """_check_accuracy without stored features: per-conversation (correct, count) at step 0 vs a recorded
    training-time metric."""
    from eyas.doctor.checks import _check_accuracy

    c, n = sum(x for x, _ in per), sum(y for _, y in per)
    serve = {"acc": [c / n], "count": [n], "sample_correct": [[x] for x, _ in per],
             "sample_count": [[y] for _, y in per]}
    return _check_accuracy(serve, None, [metric], [rows], "test path", paired=False)


def test_unpaired_accuracy_uses_the_spread_between_conversations():
    # 6 conversations at 33% (2,000 positions): 7 points below the training metric, far beyond
    # both the binomial SE (~1.1) and the spread between conversations (none here) -> skew warning
    assert _unpaired([(110, 333)] * 6).status == "warn"
    # the same pooled 33% from conversations at 15..50%: within 2 SE over conversations -> no warning,
    # although a binomial SE over the 2,000 positions alone would have warned
    spread = [(50, 333), (167, 333), (60, 333), (150, 333), (80, 333), (153, 333)]
    c = _unpaired(spread)
    assert c.status == "pass" and c.numbers["gap_se_points"] > 3.4, c.numbers
    # serving far better than at training (other, easier samples) is no sign of skew
    assert _unpaired([(180, 333)] * 6).status == "pass"


def test_ties_go_to_the_simplest_explanation():
    from eyas.probe import LayoutScore

    g = torch.Generator().manual_seed(0)
    base = torch.rand(2000, generator=g) * 5
    noise = lambda: base + 0.01 * torch.randn(2000, generator=g)  # noqa: E731
    rows = {(1, 15, 27): noise() - 0.001, (2, 15, 27): noise(), (3, 16, 28): base + 0.3, (2, 14, 27): noise()}
    scores = [LayoutScore(list(k), str(k), 0.3, float(v.mean())) for k, v in sorted(rows.items(),
                                                                                   key=lambda kv: float(kv[1].mean()))]
    r = LayoutRanking(scores, tokens=2000, rows=rows)
    assert r.best.indices == [1, 15, 27] and not r.worse([2, 15, 27], [1, 15, 27])[0]
    # recorded within noise of the lowest loss: the recorded layout is the verdict
    assert r.simplest_among_ties([2, 15, 27]).best.indices == [2, 15, 27]
    # a shifted record: the whole-layout shift back, not a one-index variant that only noise prefers
    s = r.simplest_among_ties([3, 16, 28])
    assert s.best.indices == [2, 15, 27] and len(s) == len(r) and s.rows.keys() == r.rows.keys()
    assert r.simplest_among_ties([4, 17, 29], bases=[[1, 15, 27]]).best.indices == [1, 15, 27]  # a base
    # beyond noise, the loss decides
    rows[(1, 15, 27)] = base - 0.2
    r = LayoutRanking(sorted(scores, key=lambda x: float(rows[tuple(x.indices)].mean())), rows=rows)
    assert r.simplest_among_ties([2, 15, 27]).best.indices == [1, 15, 27]


def test_layout_candidates_cover_the_brief():
    c = dict((tuple(i), lab) for i, lab in layout_candidates([2, 15, 27], 30, 3))
    assert "recorded" in c[(2, 15, 27)] and "default" in c[(2, 15, 27)]
    assert "shifted +1" in c[(3, 16, 28)] and "shifted -1" in c[(1, 14, 26)]
    assert "15->16" in c[(2, 16, 27)]
    assert "embedding (0) in place of 2" in c[(0, 15, 27)]
    assert "permuted" in c[(27, 15, 2)]
    assert "final state only" in c[()]
    assert all(len(k) in (0, 3) and all(0 <= x <= 30 for x in k) for k in c)
