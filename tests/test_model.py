"""eyas's own target forward vs Hugging Face on tiny random models of each supported family."""

from __future__ import annotations

import pytest
import torch

from eyas.engine.forward import TargetModel, compact, truncate
from eyas.target.capture import capture
from eyas.target.family import SUPPORTED, ModelError
from tests.tiny import tiny_model

ATOL = 1e-5




@pytest.mark.parametrize("family", SUPPORTED)
def test_full_forward_logits_and_capture_match_hf(family):
    m = tiny_model(family, seed=3)
    tm = TargetModel(m)
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 17))
    idx = [0, 1, 3, 6]  # embedding, inner layers and the final pre-norm state (L = 6)
    ref = capture(m, ids, idx, logits="all")
    ours = tm.capture(ids, idx, logits="all")
    torch.testing.assert_close(ours.logits, m(input_ids=ids, use_cache=False).logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.aux, ref.aux, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.final_prenorm, ref.final_prenorm, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.final_postnorm, ref.final_postnorm, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", SUPPORTED)
def test_incremental_decoding_equals_full_forward(family):
    m = tiny_model(family, seed=4)
    tm = TargetModel(m)
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (1, 24))
    full = m(input_ids=ids, use_cache=False).logits
    cache = tm.new_cache(1, 32)
    outs = [tm.forward(ids[:, :9], torch.arange(9)[None], cache, logits="all").logits]
    cache.length = 9
    for t in range(9, 24, 3):  # chunks of 3 (causal within) then the next chunk
        o = tm.forward(ids[:, t:t + 3], torch.arange(t, t + 3)[None], cache, logits="all")
        cache.length += 3
        outs.append(o.logits)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=ATOL, rtol=0)


def test_tree_mask_positions_and_compaction():
    """Verify a 2-branch tree in one forward: each branch must equal running that branch alone, and after
    compacting one branch into the prefix, decoding continues exactly as a plain sequence would."""
    m = tiny_model("llama", seed=5)
    tm = TargetModel(m)
    prefix = torch.tensor([[3, 9, 27, 81, 17]])
    # tree: root r=40, children a=41 (depth 1), b=42 (depth 1); a's child c=43 (depth 2)
    tokens = torch.tensor([[40, 41, 42, 43]])
    parents = [-1, 0, 0, 1]
    depths = torch.tensor([0, 1, 1, 2])
    mask = torch.zeros(4, 4, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    cache = tm.new_cache(1, 16)
    tm.forward(prefix, torch.arange(5)[None], cache, logits="none")
    cache.length = 5
    out = tm.forward(tokens, (depths + 5)[None], cache, tree_mask=mask, capture=[2], logits="all")
    path_a = torch.cat([prefix, torch.tensor([[40, 41, 43]])], 1)
    path_b = torch.cat([prefix, torch.tensor([[40, 42]])], 1)
    ref_a = m(input_ids=path_a, use_cache=False).logits[0, 5:]
    ref_b = m(input_ids=path_b, use_cache=False).logits[0, 5:]
    torch.testing.assert_close(out.logits[0, [0, 1, 3]], ref_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.logits[0, 2], ref_b[1], atol=ATOL, rtol=0)
    ref_cap = capture(m, path_a, [2]).aux[0, 5:]
    torch.testing.assert_close(out.aux[0, [0, 1, 3]], ref_cap, atol=ATOL, rtol=0)
    # keep root, a, c: slots 5, 6, 8 -> 5, 6, 7; then one more token
    compact(cache, 5, [0, 1, 3])
    assert cache.length == 8
    nxt = tm.forward(torch.tensor([[50]]), torch.tensor([[8]]), cache, logits="last").logits[0, -1]
    full = m(input_ids=torch.cat([path_a, torch.tensor([[50]])], 1), use_cache=False).logits[0, -1]
    torch.testing.assert_close(nxt, full, atol=ATOL, rtol=0)
    truncate(cache, 6)
    assert cache.length == 6
    with pytest.raises(ModelError, match="cannot truncate"):
        truncate(cache, 7)


def test_capture_equals_target_capture_with_layout_order():
    m = tiny_model("qwen3", seed=6)
    ids = torch.randint(0, 128, (1, 11))
    ours = TargetModel(m).capture(ids, [5, 2, 0])
    ref = capture(m, ids, [5, 2, 0])
    torch.testing.assert_close(ours.aux, ref.aux, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_unsupported_family_is_refused(family):
    with pytest.raises(ModelError, match=f"covers the llama, mistral, qwen2, qwen3, gemma3_text families, and "
                                         f"this target .* is '{family}'"):
        TargetModel(tiny_model(family))


def test_bad_inputs_are_loud():
    tm = TargetModel(tiny_model("llama"))
    cache = tm.new_cache(1, 4)
    with pytest.raises(ModelError, match="holds 4 slots"):
        tm.forward(torch.zeros(1, 5, dtype=torch.long), torch.arange(5)[None], cache)
    with pytest.raises(ModelError, match="tree_mask must be"):
        tm.forward(torch.zeros(1, 2, dtype=torch.long), torch.arange(2)[None], cache,
                   tree_mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ModelError, match="outside 0..6"):
        tm.capture(torch.zeros(1, 2, dtype=torch.long), [7])
