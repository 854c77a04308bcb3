"""eyas.engine.load: the one engine assembly, its checks before anything loads, and the tree defaults stated once
(TREE_DEFAULTS) in the help strings, the README and the Makefile."""

from __future__ import annotations

import inspect
import re
from dataclasses import fields
from pathlib import Path

import pytest

from eyas.draft import random_draft
from eyas.engine.load import EngineOptions, EngineParts, EngineUse, check_options, load_engine, make_engine
from eyas.engine.params import (
    TREE_DEFAULTS,
    EngineError,
    SamplingParams,
    SpecParams,
    TreeSettings,
    defaults_text,
    resolve_method,
)
from tests.test_engine import PROMPTS, VOCAB, make_target

ROOT = Path(__file__).resolve().parents[1]
USE = EngineUse("eyas generate")


def test_defaults_stated_once():
    import eyas.cli.decode as cli_decode

    readme, makefile = (ROOT / "README.md").read_text(), (ROOT / "Makefile").read_text()
    flat = " ".join(makefile.replace("#", " ").split())  # the Makefile's comment wraps across lines
    assert defaults_text("cpu") in " ".join(readme.split()) and defaults_text("cpu") in flat
    assert defaults_text("cuda") in " ".join(readme.split())
    helps = {f.name: f.metadata["help"] for f in fields(TreeSettings)}
    for key in ("depth", "topk", "tokens", "lookup", "min_prob"):
        assert f"default {TREE_DEFAULTS['cpu'][key]:g} on the CPU, {TREE_DEFAULTS['cuda'][key]:g} on CUDA" in helps[key]
    for command in (cli_decode.generate, cli_decode.serve, cli_decode.bench):  # declared once, offered by each
        flags = {p.default.param_decls[0] for p in inspect.signature(command).parameters.values()
                 if hasattr(p.default, "param_decls")}
        assert {f.metadata["flag"] for f in fields(TreeSettings)} <= flags, command.__name__


def test_one_place_builds_an_engine():
    """Engine( is constructed only in eyas/engine/load.py (make_engine): every command shares one assembly."""
    sites = [f"{p.relative_to(ROOT)}:{n}" for p in (ROOT / "eyas").rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"(?<![\w.])Engine\(", line) and not line.lstrip().startswith("class ")]
    assert sites and all(s.startswith("eyas/engine/load.py:") for s in sites), \
        f"build engines with eyas.engine.load.make_engine / load_engine instead: {sites}"


def test_bad_flags_fail_before_anything_loads(tmp_path):
    missing = str(tmp_path / "no-such-target")  # loading it would fail differently
    with pytest.raises(EngineError, match="tree depth 0"):
        check_options(EngineOptions(target=missing, tree=TreeSettings(depth=0)), USE)
    with pytest.raises(EngineError, match="--method chain needs a draft"):
        check_options(EngineOptions(target=missing, draft="none", method="chain"), USE)
    with pytest.raises(EngineError, match="--weights"):
        check_options(EngineOptions(target=missing, draft="none", weights="int3"), USE)
    with pytest.raises(EngineError, match="--draft-weights"):
        check_options(EngineOptions(target=missing, draft_weights="q4"), USE)


def test_options_spec_defaults():
    assert EngineOptions(draft="none").spec().method == "plain"
    s = EngineOptions(device="cuda", tree=TreeSettings(topk=3)).spec()
    assert (s.method, s.depth, s.topk, s.tokens, s.steps) == ("tree", TREE_DEFAULTS["cuda"]["depth"], 3,
                                                             TREE_DEFAULTS["cuda"]["tokens"], SpecParams.steps)


def test_load_engine_over_a_loaded_target_is_lossless():
    tiny = make_target()
    draft = random_draft(tiny, draft_vocab=VOCAB)
    opts = EngineOptions(raw=True, ngram="none")
    eng, parts = load_engine(opts, USE, target=tiny, draft=draft)
    cpu = TREE_DEFAULTS["cpu"]
    assert (eng.spec.depth, eng.spec.topk, eng.spec.tokens, eng.spec.lookup) == \
        (cpu["depth"], cpu["topk"], cpu["tokens"], cpu["lookup"])
    assert parts.target is tiny and parts.draft is draft and eng.drafts
    plain = make_engine(parts, SpecParams(method="plain"))
    assert not plain.drafts  # a plain spec gets no draft, even from parts that hold one
    sp = SamplingParams(max_new_tokens=12)
    assert eng.generate(PROMPTS[0], sp).token_ids == plain.generate(PROMPTS[0], sp).token_ids
    assert make_engine(EngineParts(tiny, None, None), SpecParams("lookup", lookup=3)).ngram is None


def test_one_place_builds_a_spec():
    """SpecParams( is constructed only by TreeSettings.spec: every command's knobs meet the device's defaults there."""
    sites = [f"{p.relative_to(ROOT)}:{n}" for p in (ROOT / "eyas").rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"(?<![\w.])SpecParams\(", line)]
    assert len(sites) == 1 and sites[0].startswith("eyas/engine/params.py:"), sites


def test_method_rule():
    assert resolve_method(None, None) == ("tree", "default")
    assert resolve_method(None, "none") == ("plain", "none")
    assert resolve_method("plain", None) == ("plain", "none")  # --method plain alone: no draft, nothing refused
    assert resolve_method("lookup", "none") == ("lookup", "none")
    assert resolve_method("chain", "random") == ("chain", "random")
    with pytest.raises(EngineError, match="--method plain decodes without a draft, but --draft default was given"):
        resolve_method("plain", "default")
    with pytest.raises(EngineError, match="--method tree needs a draft"):
        resolve_method("tree", "none")


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("flags, message", [
    (["--method", "plain", "--draft", "default"], "--method plain decodes without a draft, but --draft default"),
    (["--method", "chain", "--draft", "none"], "--method chain needs a draft"),
    (["--method", "beam"], "--method 'beam': expected one of"),
])
def test_generate_and_serve_agree_on_the_method_rule(command, flags, message, tmp_path):
    """One rule, refused the same way by both commands before anything loads (the target does not exist)."""
    from typer.testing import CliRunner

    from eyas.cli import app

    extra = ["--prompt", "hi"] if command == "generate" else ["--port", "0"]
    r = CliRunner().invoke(app, [command, "--target", str(tmp_path / "absent"), *flags, *extra])
    assert r.exit_code == 2 and message in " ".join(r.output.split()), r.output


def test_recipe_eval_and_bench_share_the_device_defaults():
    """The recipe's eval builds a BenchConfig without tree knobs: its specs are `eyas bench`'s and generate's."""
    from eyas.bench.config import BenchConfig
    from eyas.bench.load import bench_spec

    for device in ("cpu", "cuda"):
        cfg = BenchConfig(device=device)
        assert bench_spec(cfg, "tree-lookup") == EngineOptions(device=device).spec()
        d = TREE_DEFAULTS[device]
        tree = bench_spec(cfg, "tree")
        assert (tree.depth, tree.topk, tree.tokens, tree.lookup, tree.min_prob) == \
            (d["depth"], d["topk"], d["tokens"], 0, d["min_prob"])


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"], ["bench", "--methods", "plain,tree"]])
def test_a_wrong_draft_path_is_refused_before_the_target_loads(tmp_path, command):
    """The draft is checked before the target: with a target that does not exist either, the draft is named."""
    from typer.testing import CliRunner

    from eyas.cli import app

    not_a_draft = tmp_path / "plain-folder"
    not_a_draft.mkdir()
    for draft, said in ((tmp_path / "nope", "no such folder"), (not_a_draft, "has no eyas_manifest.json")):
        r = CliRunner().invoke(app, [*command, "--target", str(tmp_path / "no-target"), "--draft", str(draft)])
        assert r.exit_code == 2 and said in r.output and "no-target" not in r.output, r.output
