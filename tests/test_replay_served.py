"""`eyas replay run --export`: the streams a server taps from an export folder, read as that engine's release reads
them on the rows' target architecture, replayed beside the trained ones. The founding case at toy size: a
DeepSeek-V3 target, a custom layout whose first SGLang id is not 1, and an export written in the llama rule's ids."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from eyas.cli import app
from tests.moe import moe_config

TRAINED = [3, 4, 5]  # on 6 layers: SGLang 0.5.23's deepseek_v2 rule takes ids [3, 4, 5] as they are


@pytest.fixture(scope="module")
def founding(tmp_path_factory, smollm2_tokenizer_dir):
    import shutil

    import torch

    from eyas.draft import random_draft, save_draft
    from eyas.target.load import load_target

    root = tmp_path_factory.mktemp("served")
    cfg, cls = moe_config("deepseek_v3")
    cfg.num_hidden_layers = 6
    torch.manual_seed(0)
    model = cls(cfg).eval()
    model.config.architectures = [cls.__name__]
    model.save_pretrained(root / "target")
    for f in smollm2_tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")) or f.suffix == ".jinja":
            shutil.copy(f, root / "target" / f.name)
    tgt = load_target(str(root / "target"), dtype="fp32")
    ck = random_draft(tgt, draft_vocab=256)
    draft = save_draft(root / "draft", ck.model.float(), dataclasses.replace(ck.layout, aux_indices=TRAINED),
                       extra={"untrained": True})
    prompts = root / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Count to {i}."}) for i in (3, 4)))
    r = CliRunner().invoke(app, ["replay", "capture", "--target", str(root / "target"), "--bench", str(prompts),
                                 "--prompts", "2", "--max-new-tokens", "8", "--draft", str(draft), "--out",
                                 str(root / "rows")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["export", "--draft", str(draft), "--format", "sglang", "--target",
                                 str(root / "target"), "--out", str(root / "export")])
    assert r.exit_code == 0, r.output
    return root, draft


def run(root, draft, export, *extra: str):
    return CliRunner().invoke(app, ["replay", "run", "--rows", str(root / "rows"), "--draft", str(draft), "--sglang",
                                    "3,1,4", "--export", str(export), *extra])


def test_the_right_export_is_served_as_trained(founding):
    root, draft = founding
    cfg = json.loads((root / "export" / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == TRAINED
    r = run(root, draft, root / "export")
    assert r.exit_code == 0, r.output
    assert "sglang 0.5.23 on a DeepseekV3ForCausalLM" in r.output, r.output
    assert f"streams {TRAINED}, the trained ones" in r.output, r.output
    assert "as served" not in r.output


def test_the_llama_rule_export_is_replayed_one_layer_off(founding, tmp_path):
    import shutil

    root, draft = founding
    bad = shutil.copytree(root / "export", tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [k - 1 for k in TRAINED]  # the llama rule's ids
    (bad / "config.json").write_text(json.dumps(cfg))
    r = run(root, draft, bad, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["served"]["streams"] == [2, 3, 4] and "NOT the trained [3, 4, 5]" in out["served"]["reading"]
    assert out["served"]["rounds"] > 0  # replayed on the rows' stream 2, which the capture kept as a neighbour
    r = run(root, draft, bad)
    assert r.exit_code == 0 and "as served: accepted per position" in r.output, r.output


def test_a_release_that_would_not_load_it_is_refused_in_one_line(founding):
    root, draft = founding
    # SGLang 0.5.6 adds 1 to every id: [4, 5, 6], and layer 6 of a 6-layer target never runs
    r = run(root, draft, root / "export", "--engine-version", "0.5.6")
    assert r.exit_code == 2 and "captures 2 streams" in r.output and "Traceback" not in r.output, r.output
    r = CliRunner().invoke(app, ["replay", "run", "--rows", str(root / "rows"), "--draft", str(draft), "--depth", "2",
                                 "--topk", "2", "--tokens", "4", "--export", str(root / "export")])
    assert r.exit_code == 2 and "give --k N (vLLM) or --sglang" in r.output, r.output
