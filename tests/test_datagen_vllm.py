"""`eyas datagen --engine vllm` (eyas/data/datagen.py, eyas/data/datagen_vllm.py, eyas/vllm/session.py,
eyas/vllm/capture_worker.py).

The vllm-marked test drives the real vLLM (its own environment, `make vllm`) on the bundled target in fp32 and
skips when no vLLM python is found: vLLM writes the replies and, through extract_hidden_states, the layout's
stream states; they must equal eyas's own capture of the same token ids, and the replies eyas's own greedy fp32
regeneration. The missing-vLLM error needs no vLLM."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from eyas.cli import app
from eyas.data.datagen import DatagenConfig, run_datagen
from eyas.data.shards import ShardSet
from eyas.target.capture import capture

# fp32 on both sides; the states differ only by summation order (vLLM's fused kernels vs torch's), measured
# ~3e-6 of a token's norm. The residual stream carries massive activations (RMS ~1000 at position 0), so the
# bound is relative to each token's norm, with an absolute one scaled to the largest state.
REL_TOL = 1e-4

ROWS = [
    {"conversations": [{"from": "human", "value": "Name three birds of prey."}, {"from": "gpt", "value": "x"}]},
    {"conversations": [{"from": "human", "value": "What is 7 times 8?"}, {"from": "gpt", "value": "x"}]},
]


@pytest.mark.vllm
@pytest.mark.integration
def test_vllm_datagen_matches_eyas_capture_and_regeneration(vllm_py, smollm2, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    # stream 0 (the embedding output, vLLM id 0) in place of 2: the end SGLang's convention cannot express
    common = dict(data=str(data), num=len(ROWS), max_new_tokens=24, dtype="fp32", target_dtype="fp32",
                  shard_samples=len(ROWS), aux_indices=[0, 15, 27])
    # shared: the replies come from the capture engine itself, so CI starts one vLLM engine, not two
    m = run_datagen(DatagenConfig(out=str(tmp_path / "vllm"), engine="vllm", vllm_python=str(vllm_py),
                                  vllm_generator="shared", **common),
                    log=lambda s: None, progress=False, target=smollm2)
    assert m["complete"] and m["config"]["engine"] == "vllm" and m["config"]["regen_engine"] == "vllm"
    assert m["config"]["vllm"]["aux_ids"] == [0, 15, 27, 30]  # stream indices + the final pre-norm state (L)
    assert m["config"]["vllm"]["generator"] == "shared"
    ref = run_datagen(DatagenConfig(out=str(tmp_path / "eyas"), regen_weights="fp32", **common),
                      log=lambda s: None, progress=False, target=smollm2)
    assert ref["counts"]["samples"] == m["counts"]["samples"] == len(ROWS)

    got, want = list(ShardSet(tmp_path / "vllm").samples()), list(ShardSet(tmp_path / "eyas").samples())
    for g, w in zip(got, want, strict=True):
        assert g.row_id == w.row_id
        assert g.input_ids.tolist() == w.input_ids.tolist()  # vLLM's greedy fp32 replies = eyas's, token for token
        assert torch.equal(g.loss_mask, w.loss_mask)
        cap = capture(smollm2.model, g.input_ids[None], [0, 15, 27])  # eyas's capture of the same ids
        for mine, theirs in ((g.aux, cap.aux[0]), (g.final, cap.final_prenorm[0])):
            S = mine.shape[0]
            a, b = mine.float().view(S, -1, 576), theirs.view(S, -1, 576)
            rel = ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()
            assert rel < REL_TOL, rel
            assert (a - b).abs().max().item() < REL_TOL * b.abs().max().item()


def test_missing_vllm_python_is_one_line_naming_make_vllm(tmp_path):
    r = CliRunner().invoke(app, ["datagen", "--engine", "vllm", "--vllm-python", str(tmp_path / "no-python"),
                                 "--num", "1", "--out", str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "make vllm" in lines[0], r.output
    assert not (tmp_path / "out").exists()  # nothing is created before the check
