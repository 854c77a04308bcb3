import pytest
import torch

from eyas.layout import default_aux_indices
from eyas.target.capture import capture, decoder_parts, stream_hooks
from tests.tiny import FAMILIES, tiny_model


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_matches_hf_hidden_states(family):
    model = tiny_model(family)
    L = model.config.num_hidden_layers
    ids = torch.randint(3, 120, (2, 11))
    with torch.no_grad():
        ref = model(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(ref) == L + 1
    with stream_hooks(model, list(range(L + 1))) as store:
        with torch.no_grad():
            model(input_ids=ids)
    for k in range(L):
        assert torch.equal(store[k], ref[k]), f"{family}: stream {k} differs from HF hidden_states[{k}]"
    # stream L is the pre-norm state; HF's last entry is after the final norm
    _, _, norm = decoder_parts(model)
    assert not torch.allclose(store[L], ref[L])
    assert torch.allclose(norm(store[L]), ref[L], atol=1e-5)
    assert torch.equal(store["post"], ref[L])


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3"])
def test_capture_concatenates_in_layout_order(family):
    model = tiny_model(family)
    L = model.config.num_hidden_layers
    idx = default_aux_indices(L)
    ids = torch.randint(3, 120, (1, 9))
    cap = capture(model, ids, [idx[2], idx[0], idx[1]], logits="last")
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    H = model.config.hidden_size
    hs = out.hidden_states
    assert cap.aux.shape == (1, 9, 3 * H)
    assert torch.equal(cap.aux[..., :H], hs[idx[2]])
    assert torch.equal(cap.aux[..., H:2 * H], hs[idx[0]])
    assert torch.equal(cap.final_postnorm, hs[L])
    assert cap.final_prenorm.shape == (1, 9, H)
    assert torch.allclose(cap.logits[:, -1], out.logits[:, -1], atol=1e-5)


def test_capture_rejects_out_of_range():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="outside"):
        capture(model, torch.ones(1, 3, dtype=torch.long), [2, 3, 99])
