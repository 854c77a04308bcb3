"""Peer evidence for the speculators export.

1. Always: the exported config.json validates against speculators 0.9.0's own published config schema
   (tests/data/speculators-0.9.0-eagle3-config.schema.json, written by
   `Eagle3SpeculatorConfig.model_json_schema()` in the peer environment), and carries every key vLLM's
   speculators reader requires (vllm/transformers_utils/configs/speculators/base.py, algos.py).
2. When the peer is installed: speculators' own config and model classes load the export and give the same
   draft logits as eyas on the same inputs. speculators 0.9.0 pins transformers<=5.19 and pulls
   torchvision/torchaudio (CUDA builds that do not load beside torch 2.13 CPU), so it cannot live in eyas's
   venv; it runs in a separate one: `bash tests/peer/setup_speculators_venv.sh` (or point
   EYAS_PEER_PYTHON at any python with speculators 0.9.x). Without it the test is skipped, saying why.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.draft import load_draft
from eyas.interop.export import export_draft
from eyas.target.capture import capture
from tests.test_export import make_draft, make_target

HERE = Path(__file__).parent
SCHEMA = HERE / "data" / "speculators-0.9.0-eagle3-config.schema.json"
PEER_PYTHON = os.environ.get("EYAS_PEER_PYTHON", "/tmp/peer-venv/bin/python")
LAYOUT = [0, 3, 8]  # embedding and final pre-norm state: speculators takes ids 0..L (input-of)




# ---- a small JSON-schema checker for the subset pydantic emits (no jsonschema dependency) -------

def _resolve(schema: dict, root: dict) -> dict:
    while "$ref" in schema:
        name = schema["$ref"].split("/")[-1]
        schema = {**root["$defs"][name], **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def schema_errors(value, schema: dict, root: dict, where: str = "$") -> list[str]:
    s = _resolve(schema, root)
    if "anyOf" in s:
        options = [schema_errors(value, o, root, where) for o in s["anyOf"]]
        return [] if any(not o for o in options) else [f"{where}: matches none of anyOf: {options}"]
    if "discriminator" in s and isinstance(value, dict):  # pydantic's tagged unions
        d = s["discriminator"]
        tag = value.get(d["propertyName"])
        if tag not in d["mapping"]:
            return [f"{where}.{d['propertyName']}: {tag!r} not one of {sorted(d['mapping'])}"]
        return schema_errors(value, {"$ref": d["mapping"][tag]}, root, where)
    if "oneOf" in s:
        ok = sum(not schema_errors(value, o, root, where) for o in s["oneOf"])
        return [] if ok == 1 else [f"{where}: matches {ok} of oneOf, expected exactly 1"]
    errs: list[str] = []
    t = s.get("type")
    if t == "integer" and not (isinstance(value, int) and not isinstance(value, bool)):
        errs.append(f"{where}: expected integer, found {value!r}")
    elif t == "number" and not (isinstance(value, int | float) and not isinstance(value, bool)):
        errs.append(f"{where}: expected number, found {value!r}")
    elif t in _TYPES and not isinstance(value, _TYPES[t]):
        errs.append(f"{where}: expected {t}, found {type(value).__name__}")
    if errs:
        return errs
    if "const" in s and value != s["const"]:
        errs.append(f"{where}: expected {s['const']!r}, found {value!r}")
    if "enum" in s and value not in s["enum"]:
        errs.append(f"{where}: {value!r} not in {s['enum']}")
    if "minimum" in s and value < s["minimum"]:
        errs.append(f"{where}: {value} < minimum {s['minimum']}")
    if isinstance(value, dict):
        errs += [f"{where}: missing required {k!r}" for k in s.get("required", []) if k not in value]
        props = s.get("properties", {})
        for k, v in value.items():
            if k in props:
                errs += schema_errors(v, props[k], root, f"{where}.{k}")
            elif s.get("additionalProperties") is False:
                errs.append(f"{where}: unexpected key {k!r}")
    if isinstance(value, list) and "items" in s:
        for i, v in enumerate(value):
            errs += schema_errors(v, s["items"], root, f"{where}[{i}]")
    return errs


def test_schema_checker_catches_errors():
    root = json.loads(SCHEMA.read_text())
    assert schema_errors({"draft_vocab_size": "40"}, root, root)
    assert schema_errors({"speculators_config": {"algorithm": "eagle3"}}, root, root)  # nested required keys
    bad_tokens = {"algorithm": "eagle3", "default_proposal_method": "greedy", "verifier": {
        "name_or_path": None, "architectures": []}, "proposal_methods": [{"proposal_type": "greedy",
                                                                          "speculative_tokens": 0}]}
    assert any("minimum" in e for e in schema_errors({"speculators_config": bad_tokens}, root, root))


def test_speculators_export_matches_published_schema(tmp_path):
    target = make_target()
    src = make_draft(tmp_path / "d", target, LAYOUT)
    cfg = export_draft(src, "speculators", tmp_path / "sp", target="/models/tiny",
                       embeddings=target.embed_tokens().weight).config
    root = json.loads(SCHEMA.read_text())
    assert schema_errors(cfg, root, root) == []
    # every top-level key is one the peer's config class knows (extra keys would pass silently)
    unknown = set(cfg) - set(root["properties"])
    assert not unknown, unknown
    # what vLLM's speculators reader indexes without a default
    sc = cfg["speculators_config"]
    assert cfg["speculators_model_type"] == "eagle3" and isinstance(cfg["transformer_layer_config"], dict)
    assert sc["proposal_methods"][0]["speculative_tokens"] == 3 and sc["verifier"]["name_or_path"] == "/models/tiny"
    assert sc["default_proposal_method"] in [m["proposal_type"] for m in sc["proposal_methods"]]
    # vLLM's update_eagle3 treats an absent norm_before_residual as True: it must be written
    assert cfg["norm_before_residual"] is False
    tl = cfg["transformer_layer_config"]
    assert (tl["vocab_size"], tl["hidden_size"], tl["num_hidden_layers"]) == (128, 32, 1)
    assert tl["rope_parameters"]["rope_theta"] == tl["rope_theta"] == 50000.0
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"]) == (40, 32)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == LAYOUT


def _peer_available() -> str | None:
    if not Path(PEER_PYTHON).exists():
        return (f"no peer python at {PEER_PYTHON}: run `bash tests/peer/setup_speculators_venv.sh` or set "
                "EYAS_PEER_PYTHON to a python with speculators 0.9.x")
    # package metadata only: importing speculators takes ~10 s of CPU, the comparison itself does that once
    r = subprocess.run([PEER_PYTHON, "-c", "from importlib.metadata import version; print(version('speculators'))"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        return f"{PEER_PYTHON} has no speculators package: {r.stderr.strip().splitlines()[-1:]}"
    if not r.stdout.strip().startswith("0.9."):
        return f"{PEER_PYTHON} has speculators {r.stdout.strip()}; this test pins the 0.9 schema"
    return None


def test_speculators_loads_export_with_same_logits(tmp_path):
    why = _peer_available()
    if why:
        pytest.skip(why)
    target = make_target()
    tdir = tmp_path / "target"  # the verifier the peer reads its embeddings and layer count from
    target.model.save_pretrained(tdir)
    src = make_draft(tmp_path / "d", target, LAYOUT)
    exp = export_draft(src, "speculators", tmp_path / "sp", target=str(tdir), embeddings=target.embed_tokens().weight)
    ck = load_draft(src)
    draft = ck.model
    draft.set_embeddings(target.embed_tokens().weight)
    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(3))
    aux = capture(target.model, ids, LAYOUT).aux[:, :-1]  # [1, 15, 3H]: features of x_0..x_14
    tok, pos = ids[:, 1:], torch.arange(15)[None]  # step 0 row t: token x_{t+1} at position t
    with torch.no_grad():
        out, _ = draft(draft.fc(aux), tok, pos)
        ours = draft.logits(out)  # [1, 15, 40]
    save_file({"aux": aux.contiguous(), "input_ids": tok.contiguous(), "position_ids": pos.contiguous()},
              str(tmp_path / "inputs.safetensors"))
    r = subprocess.run([PEER_PYTHON, str(HERE / "peer" / "speculators_logits.py"), str(exp.path),
                        str(tmp_path / "inputs.safetensors"), str(tmp_path / "peer.safetensors")],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    peer = load_file(str(tmp_path / "peer.safetensors"))
    meta = json.loads((tmp_path / "peer.safetensors.json").read_text())
    assert meta["class"] == "Eagle3DraftModel" and meta["target_layer_ids"] == LAYOUT
    assert torch.equal(peer["d2t"], draft.d2t) and torch.equal(peer["t2d"], draft.t2d)
    assert torch.equal(peer["embed"], target.embed_tokens().weight)  # the table the export carries
    assert peer["logits"].shape == ours.shape
    assert torch.allclose(peer["logits"], ours, atol=1e-5, rtol=1e-5), (peer["logits"] - ours).abs().max()
    assert torch.equal(peer["logits"].argmax(-1), ours.argmax(-1))
