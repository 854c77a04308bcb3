"""Every failure caused by user input is one `error:` line and exit 2, never a traceback: missing, truncated or
foreign files, malformed rows, wrong flags, across the subcommands (eyas/cli.py `user_errors`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eyas.cli import app
from tests.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DRAFT = ROOT / "eyas" / "assets" / "drafts" / "default"


@pytest.fixture(scope="module")
def files(tmp_path_factory, smollm2):
    """Bad inputs of every kind next to two tiny HF targets (SmolLM2's tokenizer): a Llama one eyas decodes
    and a Gemma-2 one it does not."""
    root = tmp_path_factory.mktemp("cli-errors")

    def target(family: str) -> Path:
        m = tiny_model(family, vocab=smollm2.identity.vocab_size, hidden=32, layers=4)
        m.save_pretrained(root / family, safe_serialization=True)
        for f in smollm2.path.iterdir():
            if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
                shutil.copy(f, root / family / f.name)
        return root / family

    target("llama")
    target("gemma2")
    (root / "rows.jsonl").write_text('{"prompt": "hi"}\n{"nope": 1}\n')
    (root / "not-json.jsonl").write_text('{"prompt": "hi"}\n{oops\n')
    (root / "foreign.gguf").write_text("not a gguf")
    (root / "a-file").write_text("x")
    (root / "unclosed.jinja").write_text("{% for m in messages %}{{ m['content'] }}")  # no endfor
    # an eyas draft whose weights were cut short, one whose manifest was, and a foreign folder
    for name in ("trunc", "badman"):
        shutil.copytree(DEFAULT_DRAFT, root / name)
    w = (root / "trunc" / "model.safetensors").read_bytes()
    (root / "trunc" / "model.safetensors").write_bytes(w[: len(w) // 3])
    (root / "badman" / "eyas_manifest.json").write_text('{"kind": "eyas-dr')
    (root / "foreign").mkdir()
    (root / "foreign" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (root / "foreign" / "model.safetensors").write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{not json")
    # a bench folder from an interrupted run whose config.json is torn
    (root / "torn-run").mkdir()
    (root / "torn-run" / "rows.jsonl").write_text('{"prompt": "x", "method": "plain"}\n')
    (root / "torn-run" / "config.json").write_text('{"bench": "mt-')
    return root


def _cases(r: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (argv, a phrase the error line must contain)"""
    ll, g2 = str(r / "llama"), str(r / "gemma2")
    quick = ["--limit", "1", "--max-new-tokens", "2", "--methods", "plain"]
    return {
        # eyas bench
        "bench: missing prompts file": (["bench", "--bench", str(r / "nope.jsonl")], "nope.jsonl"),
        "bench: malformed prompt row": (["bench", "--bench", str(r / "rows.jsonl")], "line 2"),
        "bench: prompt row not JSON": (["bench", "--bench", str(r / "not-json.jsonl")], "not valid JSON"),
        "bench: unknown method": (["bench", "--methods", "plain,medusa"], "choose from"),
        "bench: foreign gguf target": (["bench", "--target", str(r / "foreign.gguf"), *quick], "not a GGUF file"),
        "bench: unsupported weights mode": (["bench", "--target", ll, "--weights", "int3", *quick], "--weights"),
        "bench: native weights on a HF target": (["bench", "--target", ll, "--weights", "native", *quick],
                                                 "not a GGUF target"),
        "bench: unsupported target family": (["bench", "--target", g2, *quick], "gemma2"),
        "bench: negative threads": (["bench", "--target", ll, "--threads", "-2", *quick], "--threads -2"),
        "bench: --out is a file": (["bench", "--target", ll, "--out", str(r / "a-file"), *quick], "is a file"),
        "bench: resume a torn run": (["bench", "--target", ll, "--out", str(r / "torn-run"), "--resume", *quick],
                                     "not valid JSON"),
        "bench: truncated draft weights": (["bench", "--target", ll, "--draft", str(r / "trunc"), "--limit", "1",
                                            "--methods", "chain"], "safetensors"),
        # eyas inspect / export / import
        "inspect: torn manifest": (["inspect", str(r / "badman")], "not valid JSON"),
        "inspect: foreign gguf": (["inspect", str(r / "foreign.gguf")], "not a GGUF file"),
        "export: truncated weights": (["export", "--draft", str(r / "trunc"), "--format", "vllm", "--out",
                                       str(r / "e1")], "safetensors"),
        "export: torn manifest": (["export", "--draft", str(r / "badman"), "--format", "vllm", "--out",
                                   str(r / "e2")], "not valid JSON"),
        "export: unknown format": (["export", "--draft", "default", "--format", "trt", "--out", str(r / "e3")],
                                   "--format"),
        "import: missing folder": (["import", str(r / "nope"), "--target", ll, "--out", str(r / "i1")],
                                   "not a folder"),
        "import: foreign truncated weights": (["import", str(r / "foreign"), "--target", ll, "--out",
                                               str(r / "i2")], "safetensors"),
        # eyas doctor flags
        "flags: torn manifest": (["doctor", "flags", "--draft", str(r / "badman"), "--", "vllm", "serve", "M"],
                                 "not valid JSON"),
        "flags: foreign truncated weights": (["doctor", "flags", "--draft", str(r / "foreign"), "--", "python", "-m",
                                              "sglang.launch_server", "--speculative-algorithm", "EAGLE3"],
                                             "safetensors"),
        "flags: not a serve command": (["doctor", "flags", "--draft", str(DEFAULT_DRAFT), "--", "docker", "run"],
                                       "cannot tell which engine"),
        # eyas generate / datagen / train
        "generate: malformed messages": (["generate", "--target", ll, "--draft", "none", "--messages",
                                          '[{"role": "user"}]'], "messages"),
        "datagen: malformed rows": (["datagen", "--data", str(r / "rows.jsonl"), "--target", ll, "--out",
                                     str(r / "d1"), "--num", "1"], "conversation"),
        "train: missing shards": (["train", "--data", str(r / "nope"), "--out", str(r / "t1")], "manifest"),
        # --chat-template (eyas/template.py): checked before anything loads
        "generate: unknown template name": (["generate", "--target", ll, "--draft", "none", "--prompt", "hi",
                                             "--chat-template", "chatml3"], "neither a built-in template"),
        "bench: unreadable template file": (["bench", "--target", ll, "--chat-template", str(r), *quick],
                                            "cannot read it"),
        "datagen: template and --raw": (["datagen", "--target", ll, "--out", str(r / "d2"), "--raw",
                                         "--chat-template", "chatml"], "contradict"),
        "inspect: broken template file": (["inspect", ll, "--chat-template", str(r / "unclosed.jinja")],
                                          "not a valid Jinja template"),
        "serve: unknown template name": (["serve", "--target", ll, "--chat-template", "vicuna"], "chatml, gemma"),
    }


CASE_NAMES = list(_cases(Path("/x")))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input_is_one_error_line(files, name):
    argv, phrase = _cases(files)[name]
    r = CliRunner().invoke(app, argv)
    assert r.exception is None or isinstance(r.exception, SystemExit), \
        f"{name}: {type(r.exception).__name__}: {r.exception}"
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1, r.output
    assert "Traceback" not in r.output and phrase in errors[0], r.output


@pytest.mark.parametrize("argv", [["bench", "--bench", "{}/nope.jsonl"], ["inspect", "{}/badman"]])
def test_real_process_prints_no_traceback(files, argv):
    """The same through a real `python -m eyas` process (CliRunner would hide an uncaught traceback)."""
    cmd = [sys.executable, "-m", "eyas", *[a.format(files) for a in argv]]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert [line for line in p.stderr.splitlines() if line.startswith("error:")], p.stderr
