"""`eyas train`'s planning, no training run: draft-vocabulary selection (and a warm start's vocabulary that misses
new data, named), the epoch plan's determinism and budget, the learning-rate schedule and the time-budget
step schedule."""

import pytest
import torch

from eyas.train.config import TrainConfig
from eyas.train.sources import Item, plan_epoch
from eyas.train.step import lr_at, schedule_step
from eyas.vocab import DraftVocab, VocabError, count_tokens, select_draft_vocab, stale_vocab_warning, vocab_hash

# ---- vocab and planning ---------------------------------------------------------------------------

def test_draft_vocab_selection():
    ids = torch.tensor([5, 5, 5, 3, 3, 9, 7, 7, 7, 7])
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1, 1, 0]).bool()  # the last 7 is not an assistant token
    counts = count_tokens([(ids, mask)], 12)
    assert counts[5] == 3 and counts[7] == 3 and counts[3] == 2 and counts.sum() == 9
    v = select_draft_vocab(counts, 3, always=[1], source_hash="sha256:abc")
    # top-2 by count (5 and 7 tie at 3: both in), plus the forced end-of-turn id 1
    assert v.ids.tolist() == [1, 5, 7] and v.always == [1]
    assert v.coverage == pytest.approx(6 / 9) and v.counted_tokens == 9
    assert v.to_manifest()["hash"] == vocab_hash(torch.tensor([1, 5, 7]))
    assert v.to_manifest()["source_dataset_hash"] == "sha256:abc"
    big = select_draft_vocab(counts, 100)  # clamped to the target vocab
    assert big.size == 12 and big.coverage == 1.0
    with pytest.raises(VocabError, match="end-of-turn"):
        select_draft_vocab(counts, 1, always=[1, 2])
    with pytest.raises(VocabError, match="no assistant"):
        select_draft_vocab(torch.zeros(12, dtype=torch.long), 4)
    with pytest.raises(VocabError, match="outside the vocabulary"):
        count_tokens([(torch.tensor([50]), torch.tensor([True]))], 12)


def test_a_warm_start_vocabulary_that_misses_the_new_data_is_named():
    """Both vocabularies are scored on held-out counts: a kept vocabulary chosen on other text that misses them
    gets a warning with both coverages and the flag; one as good as a fresh one on held-out rows (or within 2
    points) says nothing, however much better fresh covers the training rows it was chosen on."""
    train = torch.zeros(20, dtype=torch.long)
    train[[4, 5, 6]] = torch.tensor([50, 30, 19])
    train[9] = 1
    heldout = train.clone()

    def warning(ids: list[int]) -> str | None:
        t = torch.tensor(ids)
        kept = DraftVocab(ids=t, target_vocab_size=20, coverage=0.0, counted_tokens=0, always=[1], source_hash="",
                          requested_size=len(ids))
        return stale_vocab_warning(kept, select_draft_vocab(train, len(ids), always=[1]), heldout)

    msg = warning([1, 4, 9, 12])  # 51% of the held-out tokens; fresh [1, 4, 5, 6]: 99%
    assert msg is not None and "51.0%" in msg and "99.0%" in msg and "--refresh-vocab" in msg
    assert warning([1, 4, 5, 6]) is None
    heldout[9] = 2  # now 6 (19) and 9 (2) differ by 17 of 101 tokens: kept [1, 4, 5, 9] is 17 points short
    assert warning([1, 4, 5, 9]) is not None
    heldout[6], heldout[9] = 3, 2  # 1 of 85 tokens: within 2 points, nothing to say
    assert warning([1, 4, 5, 9]) is None
    # fresh is picked on the training rows (token 6 is frequent there) but the held-out rows use 9 instead: kept
    # [1, 4, 5, 9] covers 100% of them, fresh [1, 4, 5, 6] less: no warning, although fresh covers 99% of the
    # training rows against the kept vocabulary's 81%
    heldout[6], heldout[9] = 0, 19
    assert warning([1, 4, 5, 9]) is None
    assert warning([1, 4, 12, 13]) is not None  # misses 5 and 9 on held-out rows too
    assert warning([1, 4, 5, 9]) is None and stale_vocab_warning(
        DraftVocab(ids=torch.tensor([1, 12]), target_vocab_size=20, coverage=0.0, counted_tokens=0, always=[1],
                   source_hash="", requested_size=2),
        select_draft_vocab(train, 2, always=[1]), torch.zeros(20, dtype=torch.long)) is None  # no held-out rows


def test_plan_epoch_is_deterministic_and_respects_the_budget():
    items = [Item(key=(i % 3, i), length=5 + (i * 7) % 40, row_id=i) for i in range(100)]
    groups = [(0, 100), (1, 100), (2, 100)]
    a = plan_epoch(items, groups, seed=1, epoch=0, batch_tokens=128, max_len=32, buffer_bytes=150)
    assert a == plan_epoch(items, groups, seed=1, epoch=0, batch_tokens=128, max_len=32, buffer_bytes=150)
    assert a != plan_epoch(items, groups, seed=1, epoch=1, batch_tokens=128, max_len=32, buffer_bytes=150)
    assert sorted(i for b in a for i in b) == list(range(100))  # every sample once
    for b in a:
        assert len(b) * max(min(items[i].length, 32) for i in b) <= 128
        assert len({items[i].key[0] for i in b}) == 1  # a window of one shard (buffer holds one)


def test_lr_schedule():
    cfg = TrainConfig(data=[], out="", lr=1.0, warmup_ratio=0.1, min_lr_ratio=0.0)
    lrs = [lr_at(s, 100, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:], strict=False)) and lrs[-1] < 0.01


def test_schedule_step_follows_a_time_budget_when_it_is_ahead():
    assert schedule_step(10, 100, 500.0, None) == 10  # no budget: the step count
    assert schedule_step(10, 100, 30.0, 60.0) == 50  # half the budget spent: half-way through the schedule
    assert schedule_step(70, 100, 30.0, 60.0) == 70  # the steps are further along
    cfg = TrainConfig(data=[], out="", lr=1.0, warmup_ratio=0.1)
    assert lr_at(schedule_step(3, 100, 60.0, 60.0), 100, cfg) < 1e-3  # the budget spent: annealed
