import json

import pytest
import torch

from eyas.target.capture import capture
from eyas.target.convert import file_fingerprint
from eyas.target.load import load_target

pytestmark = pytest.mark.integration


def test_bundled_target_identity_and_layout(smollm2):
    t = smollm2
    assert t.identity.num_layers == 30 and t.identity.hidden_size == 576 and t.identity.vocab_size == 49152
    lay = t.default_layout()
    assert lay.aux_indices == [2, 15, 27]
    assert lay.engine_ids("sglang") == [1, 14, 26]
    assert lay.engine_ids("vllm") == [2, 15, 27]
    assert t.identity.fingerprint.startswith("sha256:")


def test_bundled_capture_shapes_and_norms(smollm2):
    t = smollm2
    ids = t.tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
    cap = capture(t.model, ids, t.default_layout(), logits="last")
    S = ids.shape[1]
    assert cap.aux.shape == (1, S, 3 * 576) and cap.final_prenorm.shape == (1, S, 576)
    # the deep layers' norms dwarf the embedding's: the trap of feeding the wrong mix
    assert cap.aux[..., -576:].norm(dim=-1).mean() > 50 * t.embed_tokens()(ids).norm(dim=-1).mean()


def test_inspect_json_cli():
    from typer.testing import CliRunner

    from eyas.cli import app

    res = CliRunner().invoke(app, ["inspect", "smollm2-135m", "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output[res.output.index("{"):])
    assert info["num_layers"] == 30 and info["hidden_size"] == 576 and info["vocab_size"] == 49152
    assert info["aux_stream_indices"] == [2, 15, 27] and info["sglang_ids"] == [1, 14, 26]
    assert info["mean_l2_norm"]["embedding (0)"] < info["mean_l2_norm"]["27"] / 50


def test_fingerprint_changes_with_weights(tmp_path):
    a = tmp_path / "w.bin"
    a.write_bytes(b"\0" * 1000)
    f1 = file_fingerprint([a])
    a.write_bytes(b"\0" * 999 + b"\1")
    assert file_fingerprint([a]) != f1


def test_hf_folder_and_bad_target(tmp_path):
    from tests.tiny import tiny_model

    m = tiny_model("qwen2")
    m.save_pretrained(tmp_path / "tiny")
    from transformers import PreTrainedTokenizerFast  # noqa: F401

    with pytest.raises(ValueError, match="not a bundled name"):
        load_target(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="--dtype"):
        load_target("smollm2-135m", dtype="fp8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA"):
            load_target("smollm2-135m", device="cuda")
