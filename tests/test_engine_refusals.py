"""No silent adjustments: the engine refuses inconsistent tree / chain shapes, a speculative method without a
draft, bad sampling parameters and prompts, and a draft made for another target (fingerprint or hidden size),
each with an error that names the rule; chat_input_ids renders the chat template and refuses a message
without a role. On the untrained tiny target of tests/test_engine.py.
"""

from __future__ import annotations

import pytest

from eyas.draft import DraftCheckpoint, DraftConfig, DraftError, Eagle3Draft, random_draft
from eyas.engine.decode import Engine
from eyas.engine.params import EngineError, SamplingParams, SpecParams
from eyas.engine.prompt import chat_input_ids
from tests.test_engine import make_target


@pytest.fixture(scope="module")
def tiny():
    return make_target()


# ---- no silent adjustments ----------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,match", [
    (SpecParams("chain", steps=0), "steps 0 < 1"),
    (SpecParams("tree", depth=3, topk=1, tokens=6), "tokens must be depth \\+ 1 = 4"),
    (SpecParams("tree", depth=2, topk=3, tokens=14), "at most 1 \\+ topk \\+ \\(depth-1\\)\\*topk\\^2 = 13"),
    (SpecParams("tree", depth=0, topk=3, tokens=4), "depth 0 < 1"),
    (SpecParams("tree", depth=3, topk=0, tokens=4), "topk 0 < 1"),
    (SpecParams("tree", depth=3, topk=2, tokens=1), "tokens 1 < 2"),
    (SpecParams("tree", depth=2, topk=200, tokens=10), "exceeds the draft vocabulary"),
    (SpecParams("beam"), "expected one of tree, chain, lookup, plain"),
])
def test_inconsistent_spec_params_raise(tiny, spec, match):
    with pytest.raises(EngineError, match=match):
        Engine(tiny, random_draft(tiny), spec)


def test_speculative_method_needs_a_draft(tiny):
    for m in ("tree", "chain"):
        with pytest.raises(EngineError, match="needs an EAGLE-3 draft"):
            Engine(tiny, None, SpecParams(method=m))


def test_bad_sampling_params_and_prompts(tiny):
    eng = Engine(tiny, None, SpecParams(method="plain"))
    for sp, match in [(SamplingParams(temperature=-1), "temperature"), (SamplingParams(top_p=0), "top_p"),
                      (SamplingParams(top_k=-2), "top_k"), (SamplingParams(max_new_tokens=0), "max_new_tokens"),
                      (SamplingParams(stop=[""]), "non-empty"), (SamplingParams(max_new_tokens=300), "positions")]:
        with pytest.raises(EngineError, match=match):
            eng.generate([1, 2], sp)
    with pytest.raises(EngineError, match="empty prompt"):
        eng.stream([], SamplingParams())  # raised when called, before any iteration
    with pytest.raises(EngineError, match="0..127"):
        eng.generate([1, 128], SamplingParams())


def test_draft_for_another_target_is_refused(tiny):
    other = make_target(seed=9)  # same shapes, different weights -> different fingerprint
    with pytest.raises(ValueError, match="fingerprint"):
        Engine(tiny, random_draft(other), SpecParams("chain", steps=2))
    wide = make_target(seed=0)
    cfg = DraftConfig.from_target_config(wide.model.config, draft_vocab_size=16, target_hidden_size=48)
    bad = DraftCheckpoint(model=Eagle3Draft(cfg), layout=tiny.default_layout(), manifest={})
    with pytest.raises(DraftError, match="target_hidden_size 48"):
        Engine(tiny, bad, SpecParams("chain", steps=2))


def test_chat_input_ids_uses_template(smollm2_tokenizer):
    ids = chat_input_ids(smollm2_tokenizer, [{"role": "user", "content": "Hi"}])
    text = smollm2_tokenizer.decode(ids)
    assert text.rstrip().endswith("<|im_start|>assistant") and "Hi" in text
    with pytest.raises(EngineError, match="role"):
        chat_input_ids(smollm2_tokenizer, [{"content": "x"}])
