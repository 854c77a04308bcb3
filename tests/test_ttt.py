"""TTT alignment, loss and accuracy on tiny random models (seconds)."""

import pytest
import torch

from eyas.draft import DraftConfig, Eagle3Draft
from eyas.target.capture import decoder_parts
from eyas.train.ttt import TTTError, step_counts, target_labels, ttt_forward
from tests.tiny import tiny_model

V, H = 128, 32


def _draft(seed=0, vd=64, nh=4, nkv=2):
    torch.manual_seed(seed)
    c = DraftConfig(hidden_size=H, target_hidden_size=H, num_attention_heads=nh, num_key_value_heads=nkv,
                    head_dim=H // nh, intermediate_size=2 * H, vocab_size=V, draft_vocab_size=vd)
    d = Eagle3Draft(c)
    d.set_vocab_map(torch.randperm(V)[:vd].sort().values)
    d.set_embeddings(torch.randn(V, H))
    return d


def _batch(B=2, S=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(B, S, 3 * H, generator=g) * 5
    final = torch.randn(B, S, H, generator=g) * 3
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = torch.rand(B, S, generator=g) > 0.3
    return aux, final, ids, mask


@pytest.fixture(scope="module")
def target():
    m = tiny_model("llama")
    _, _, norm = decoder_parts(m)
    return norm, m.get_output_embeddings()


def _by_hand(d, aux, ids, b, t, steps):
    """The engine's view of row t of sample b: step 0 over rows 0..t with a cache, then chain depths."""
    x = ids[b:b + 1]
    h0 = d.fc(aux[b:b + 1, :t + 1])
    out, kv = d.forward(h0, x[:, 1:t + 2], torch.arange(t + 1)[None])  # plain causal over rows 0..t
    logits = [d.logits(out)[0, -1]]
    h = out[:, -1:]
    for j in range(1, steps):
        past = kv[0].shape[2]
        mask = torch.ones(1, 1, 1, past + 1, dtype=torch.bool)  # all of the past + itself
        h, kv = d.forward(h, x[:, t + 1 + j:t + 2 + j], torch.tensor([[t + j]]), past_kv=kv, mask=mask)
        logits.append(d.logits(h)[0, -1])
    return logits


@pytest.mark.parametrize("nh,nkv", [(4, 2), (4, 4)])
def test_alignment_matches_engine_view(target, nh, nkv):
    """Step-j logits of ttt_forward at row t equal a direct draft forward built by hand for that row."""
    d = _draft(nh=nh, nkv=nkv)
    aux, final, ids, mask = _batch()
    steps = 3
    out = ttt_forward(d, aux, final, ids, mask, *target, steps, return_logits=True)
    S = ids.shape[1]
    for b in range(2):
        for t in [0, 3, S - 1 - steps]:
            ref = _by_hand(d, aux, ids, b, t, steps)
            for j in range(steps):
                assert torch.allclose(out.logits[j][b, t], ref[j], atol=1e-4), (b, t, j)
    # the step-0 row count: S-1 rows (every row has an input token); step j has S-1-j
    assert [lg.shape[1] for lg in out.logits] == [S - 1, S - 2, S - 3]


def test_loss_and_accuracy_definition(target):
    d = _draft()
    aux, final, ids, mask = _batch()
    steps = 2
    norm, head = target
    out = ttt_forward(d, aux, final, ids, mask, norm, head, steps, return_logits=True)
    draft_ids = d.target_token_ids()
    probs, top = target_labels(final, norm, head, draft_ids)
    full = head(norm(final))
    assert torch.equal(top, full.argmax(-1))
    assert torch.allclose(probs, torch.softmax(full[..., draft_ids], -1), atol=1e-6)
    S = ids.shape[1]
    total = 0.0
    for j in range(steps):
        n = S - 1 - j
        lg = out.logits[j]
        ok = torch.zeros(2, n, dtype=torch.bool)
        ok[:, :n - 1] = mask[:, 2 + j:]
        ce = -(probs[:, 1 + j:1 + j + n] * torch.log_softmax(lg, -1)).sum(-1)
        assert out.step_count[j] == ok.sum()
        assert torch.allclose(out.step_loss[j], ce[ok].mean(), atol=1e-5)
        pred = draft_ids[lg.argmax(-1)]
        hit = (pred == top[:, 1 + j:1 + j + n]) & ok
        assert out.step_correct[j] == hit.sum()
        assert out.row_correct[:, j].tolist() == hit.sum(1).tolist()  # per sample, for a per-conversation SE
        assert out.row_count[:, j].tolist() == ok.sum(1).tolist()
        total = total + 0.8 ** j * ce[ok].mean()
    assert torch.allclose(out.loss, total, atol=1e-5)
    assert torch.equal(out.step_count, step_counts(mask, steps))


def test_draft_vocab_labels_match_the_full_head(target):
    # training's cheaper labels: same probabilities; argmax = the target's top token within the draft vocab
    d = _draft()
    _, final, _, _ = _batch()
    norm, head = target
    draft_ids = d.target_token_ids()
    probs, top = target_labels(final, norm, head, draft_ids)
    probs_d, top_d = target_labels(final, norm, head, draft_ids, full_argmax=False)
    assert torch.allclose(probs_d, probs, atol=1e-6)
    full = head(norm(final))
    assert torch.equal(top_d, draft_ids[full[..., draft_ids].argmax(-1)])
    inside = torch.isin(top, draft_ids)
    assert torch.equal(top_d[inside], top[inside])
    assert inside.any() and not inside.all(), "the fixture should have target tops on both sides of the draft vocab"


def test_padding_rows_do_not_change_results(target):
    """A right-padded shorter sample gives the same logits and counts as the sample alone."""
    d = _draft()
    aux, final, ids, mask = _batch(B=2, S=12)
    L = 8
    mask[1, L:] = False
    aux[1, L:] = 0
    final[1, L:] = 0
    padded = ttt_forward(d, aux, final, ids, mask, *target, 3, return_logits=True)
    alone = ttt_forward(d, aux[1:, :L], final[1:, :L], ids[1:, :L], mask[1:, :L], *target, 3,
                        return_logits=True)
    first = ttt_forward(d, aux[:1], final[:1], ids[:1], mask[:1], *target, 3)
    for j in range(3):
        n = L - 1 - j
        assert torch.allclose(padded.logits[j][1, :n], alone.logits[j][0], atol=1e-5)
    assert torch.equal(padded.step_count, alone.step_count + first.step_count)
    assert torch.equal(padded.step_correct, alone.step_correct + first.step_correct)


def test_gradients_flow_through_the_unroll(target):
    d = _draft()
    aux, final, ids, mask = _batch()
    mask[:, :3] = False  # step 0's first valid rows gone; later steps still see fed-back hidden
    out = ttt_forward(d, aux, final, ids, mask, *target, 3)
    out.loss.backward()
    assert d.fc.weight.grad is not None and d.fc.weight.grad.abs().sum() > 0
    assert d.midlayer.self_attn.q_proj.weight.grad.abs().sum() > 0
    assert d.lm_head.weight.grad.abs().sum() > 0


def test_short_samples_and_bad_shapes(target):
    d = _draft()
    aux, final, ids, mask = _batch(S=3)
    out = ttt_forward(d, aux, final, ids, mask, *target, 5)  # steps beyond the sample have no rows
    assert out.step_count[2:].sum() == 0 and torch.isfinite(out.loss)
    with pytest.raises(TTTError, match="aux width"):
        ttt_forward(d, aux[..., :H], final, ids, mask, *target, 2)
    with pytest.raises(TTTError, match="steps"):
        ttt_forward(d, aux, final, ids, mask, *target, 0)
