"""Every failure caused by user input is one `error:` line and exit 2, never a traceback: missing, truncated or
foreign files, malformed rows, wrong flags, across the subcommands (eyas/cli/common.py `user_errors`)."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eyas.cli import app
from tests.tiny import gguf_bytes, tiny_model

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DRAFT = ROOT / "eyas" / "assets" / "drafts" / "default"


@pytest.fixture(scope="module")
def files(tmp_path_factory, smollm2_tokenizer, smollm2_tokenizer_dir):
    """Bad inputs of every kind next to two tiny HF targets (SmolLM2's tokenizer): a Llama one eyas decodes
    and a Gemma-2 one it does not."""
    root = tmp_path_factory.mktemp("cli-errors")

    def target(family: str) -> Path:
        m = tiny_model(family, vocab=len(smollm2_tokenizer), hidden=32, layers=4)
        m.save_pretrained(root / family, safe_serialization=True)
        for f in smollm2_tokenizer_dir.iterdir():
            if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
                shutil.copy(f, root / family / f.name)
        return root / family

    target("llama")
    target("gemma2")
    # a family the engine forward does not cover, whose weights are garbage: the refusal must come from
    # config.json alone (a check that loaded the weights first would fail on them instead)
    target("phi3")
    (root / "phi3" / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    (root / "phi3.gguf").write_bytes(gguf_bytes("phi3"))  # the same from GGUF metadata: no tensors at all
    # a HF folder whose config.json is garbage, one whose weights were cut short
    shutil.copytree(root / "llama", root / "badconfig")
    (root / "badconfig" / "config.json").write_text('{"model_type": "lla')
    shutil.copytree(root / "llama", root / "nomodel")
    (root / "nomodel" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')  # JSON, no model
    shutil.copytree(root / "llama", root / "notokenizer", ignore=shutil.ignore_patterns("tokenizer*", "*.jinja"))
    shutil.copytree(root / "llama", root / "cutweights")
    w = (root / "cutweights" / "model.safetensors").read_bytes()
    (root / "cutweights" / "model.safetensors").write_bytes(w[: len(w) // 2])
    # a GGUF cut inside a K-quant tensor (Q4_K: 144 bytes per 256 weights), one with a bad magic
    (root / "cut.gguf").write_bytes(gguf_bytes("llama", [("blk.0.ffn_up.weight", (256, 8), 12, 8 * 144)])[:-600])
    (root / "badmagic.gguf").write_bytes(b"GGUG" + gguf_bytes("llama")[4:])
    # conversations every one of which datagen skips: no assistant reply, and replies past --max-len
    (root / "unanswered.jsonl").write_text("".join(json.dumps({"conversations": [{"from": "human", "value": q}]})
                                                   + "\n" for q in ("hi", "hello?")))
    (root / "late.jsonl").write_text("".join(json.dumps({"conversations": [
        {"from": "human", "value": "Tell me about hawks. " * 4}, {"from": "gpt", "value": a}]}) + "\n"
        for a in ("They hunt.", "They fly.", "Eyases are young hawks.")))
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
    ll, g2, p3, p3g = str(r / "llama"), str(r / "gemma2"), str(r / "phi3"), str(r / "phi3.gguf")
    quick = ["--limit", "1", "--max-new-tokens", "2", "--methods", "plain"]
    return {
        # a family the engine forward does not cover: refused from config.json / GGUF metadata before any load,
        # naming what works instead
        "bench: uncovered family (HF folder)": (["bench", "--target", p3, "--limit", "1"], "--methods hf-greedy"),
        "bench: uncovered family (GGUF)": (["bench", "--target", p3g, *quick], "'phi3'"),
        "bench --sweep: uncovered family": (["bench", "--target", p3, "--sweep"], "without --sweep"),
        "generate: uncovered family": (["generate", "--target", p3, "--draft", "none", "--prompt", "hi"],
                                       "covers the llama, mistral, qwen2, qwen3, gemma3_text families, and"),
        "generate: uncovered family (GGUF)": (["generate", "--target", p3g, "--draft", "none", "--prompt", "hi"],
                                              "from general.architecture 'phi3' in phi3.gguf"),
        "serve: uncovered family": (["serve", "--target", p3, "--draft", "none"], "'phi3'"),
        "doctor trace: uncovered family": (["doctor", "trace", "--target", p3, "--draft", "default", "--prompt",
                                           "hi"], "without trace"),
        # bad or truncated model files
        "inspect: garbage config.json": (["inspect", str(r / "badconfig")], "not valid JSON"),
        "generate: garbage config.json": (["generate", "--target", str(r / "badconfig"), "--draft", "none",
                                           "--prompt", "hi"], "config.json is not valid JSON"),
        "inspect: config.json that names no model": (["inspect", str(r / "nomodel")], "transformers could not load"),
        "inspect: folder without a tokenizer": (["inspect", str(r / "notokenizer")], "tokenizer files"),
        "datagen: truncated target weights": (["datagen", "--data", str(r / "late.jsonl"), "--target",
                                               str(r / "cutweights"), "--out", str(r / "d3"), "--no-regenerate"],
                                              "not a readable safetensors file"),
        "inspect: truncated K-quant gguf": (["inspect", str(r / "cut.gguf")], "truncated"),
        "inspect: gguf with a bad magic": (["inspect", str(r / "badmagic.gguf")], "no GGUF magic"),
        # zero samples is a failure, naming the reasons
        "datagen: every row unanswered": (["datagen", "--data", str(r / "unanswered.jsonl"), "--target", ll,
                                           "--out", str(r / "d4"), "--no-regenerate", "--quiet"],
                                          "no_assistant_turn 2"),
        "datagen: every reply past --max-len": (["datagen", "--data", str(r / "late.jsonl"), "--target", ll,
                                                 "--out", str(r / "d5"), "--no-regenerate", "--max-len", "8",
                                                 "--quiet"], "no_loss_tokens_after_truncation 3; "),
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
        # a draft on another target: one line naming both, before any work (README's first hour)
        "export: draft for another target": (["export", "--draft", "default", "--format", "vllm", "--target", ll,
                                              "--out", str(r / "e4")], "trained for smollm2-135m"),
        "bench: draft for another target": (["bench", "--target", ll, "--draft", "default", "--limit", "1",
                                             "--methods", "tree"], "trained for smollm2-135m"),
        "doctor: draft for another target": (["doctor", "--target", ll, "--draft", "default", "--quick"],
                                             "trained for smollm2-135m"),
        "serve: draft for another target": (["serve", "--target", ll, "--draft", "default"],
                                            "trained for smollm2-135m"),
        # checked before the model loads
        "serve: prefill chunk below 16": (["serve", "--target", ll, "--prefill-chunk", "8"],
                                          "--prefill-chunk must be >= 16 tokens (or 0: whole prompts), got 8"),
        "serve: negative prefill chunk": (["serve", "--target", ll, "--prefill-chunk", "-256"], "got -256"),
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


def test_serve_prefill_chunk_reaches_the_engine(files, monkeypatch):
    """--prefill-chunk is documented in the help, and the value given is the engine's chunk (the default is the
    server's own default)."""
    import typer

    import eyas.serve.config as srv
    import eyas.serve.launch as launch

    opt = next(o for o in typer.main.get_command(app).commands["serve"].params if "--prefill-chunk" in o.opts)
    assert opt.default == srv.PREFILL_CHUNK and ">= 16" in opt.help and "waits about one chunk" in opt.help
    assert "--prefill-chunk" in CliRunner().invoke(app, ["serve", "--help"]).output
    served = []
    monkeypatch.setattr(launch, "run", lambda app_, host, port, log_level="info": served.append(app_))
    for argv, want in (([], srv.PREFILL_CHUNK), (["--prefill-chunk", "64"], 64), (["--prefill-chunk", "0"], 0)):
        r = CliRunner().invoke(app, ["serve", "--target", str(files / "llama"), "--draft", "none", *argv])
        assert r.exit_code == 0, r.output
        assert served[-1].state.config.prefill_chunk == want and served[-1].state.worker.engine.prefill_chunk == want
    opt = next(o for o in typer.main.get_command(app).commands["serve"].params if "--max-long-prompts" in o.opts)
    assert opt.default == srv.MAX_LONG_PROMPTS and "503" in opt.help
    r = CliRunner().invoke(app, ["serve", "--target", str(files / "llama"), "--draft", "none", "--max-long-prompts",
                                 "3", "--prefill-chunk", "64"])
    assert r.exit_code == 0, r.output
    assert (served[-1].state.worker.max_long, served[-1].state.worker.long_prompt) == (3, 64)
    r = CliRunner().invoke(app, ["serve", "--target", str(files / "llama"), "--max-long-prompts", "0"])
    assert r.exit_code == 2 and "--max-long-prompts must be >= 1, got 0" in r.output, r.output


def _one_error(r) -> str:
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "Traceback" not in r.output, r.output
    return errors[0]


def test_failed_gguf_targets_leave_nothing_in_the_cache(tmp_path, monkeypatch):
    """A truncated file, a bad magic, a family refusal and a file transformers cannot convert: one error line
    each, and the cache holds nothing afterwards (not even the temporary folder of a conversion killed earlier)."""
    import transformers

    from eyas.target.convert import file_fingerprint

    # transformers' log handler binds sys.stderr when first used: the real one, not a CliRunner's closed stream
    transformers.logging.get_verbosity()
    cache = tmp_path / "cache"
    monkeypatch.setenv("EYAS_CACHE", str(cache))
    bad = {"cut.gguf": gguf_bytes("llama", [("blk.0.attn_q.weight", (256, 4), 14, 4 * 210)])[:-100],  # Q6_K
           "magic.gguf": b"GGML" + gguf_bytes("llama")[4:],
           "phi3.gguf": gguf_bytes("phi3"),
           # a whole, well-formed file with no tokenizer or config keys: transformers cannot convert it
           "hollow.gguf": gguf_bytes("llama", [("token_embd.weight", (8, 4), 0, 128)])}
    for name, data in bad.items():
        (tmp_path / name).write_bytes(data)
    hollow = tmp_path / "hollow.gguf"
    killed = cache / "targets" / f"hollow-{file_fingerprint([hollow]).split(':')[1][:12]}.tmp-999999999"
    killed.mkdir(parents=True)
    (killed / "model.safetensors").write_bytes(b"half")
    runner = CliRunner()
    assert "truncated" in _one_error(runner.invoke(app, ["inspect", str(tmp_path / "cut.gguf")]))
    assert "no GGUF magic" in _one_error(runner.invoke(app, ["inspect", str(tmp_path / "magic.gguf")]))
    assert "'phi3'" in _one_error(runner.invoke(app, ["generate", "--target", str(tmp_path / "phi3.gguf"),
                                                      "--draft", "none", "--prompt", "hi"]))
    line = _one_error(runner.invoke(app, ["inspect", str(hollow), "--raw"]))  # --raw: it carries no template
    assert "transformers could not read" in line and "hollow.gguf" in line, line
    assert not any((cache / "targets").iterdir()), list((cache / "targets").iterdir())


def test_zero_sample_datagen_fails_and_train_names_its_reasons(files):
    """datagen that kept nothing exits 2 naming the reasons but still commits its manifest (rows read, skipped);
    train on that folder names the same reasons (from the manifest) instead of a bare 'no training samples'."""
    out = files / "zero"
    runner = CliRunner()
    line = _one_error(runner.invoke(app, ["datagen", "--data", str(files / "late.jsonl"), "--target",
                                          str(files / "llama"), "--out", str(out), "--no-regenerate", "--max-len",
                                          "8", "--quiet"]))
    assert "all 3 source rows" in line and "raise --max-len" in line, line
    m = json.loads((out / "manifest.json").read_text())
    assert m["skipped"] == {"no_loss_tokens_after_truncation": 3} and m["counts"]["samples"] == 0 and m["complete"]
    line = _one_error(runner.invoke(app, ["train", "--data", str(out), "--out", str(files / "t-zero")]))
    assert "no training samples" in line and "no_loss_tokens_after_truncation 3" in line, line
    assert not (files / "t-zero" / "draft").exists()


def test_failed_first_datagen_creates_no_out_folder(files):
    """A first datagen run that fails on its inputs (a missing .gguf, a truncated or foreign target, a missing
    conversation file, bad --aux-indices) is one error line and leaves no --out folder (nor its lock file) behind:
    the next try should not find a half-made folder."""
    ll = str(files / "llama")
    runner = CliRunner()
    for name, extra, phrase in [
            ("missing-gguf", ["--target", str(files / "nope.gguf")], "no such GGUF file"),
            ("foreign-gguf", ["--target", str(files / "foreign.gguf")], "not a GGUF file"),
            ("cut-weights", ["--target", str(files / "cutweights")], "not a readable safetensors file"),
            ("missing-data", ["--target", ll, "--data", str(files / "nope.jsonl")], "nope.jsonl"),
            ("bad-aux", ["--target", ll, "--aux-indices", "1,2,99"], "--aux-indices")]:
        out = files / f"first-{name}"
        argv = ["datagen", "--data", str(files / "late.jsonl"), "--out", str(out), "--no-regenerate", "--quiet",
                *extra]
        assert phrase in _one_error(runner.invoke(app, argv)), name
        assert not out.exists(), (name, list(out.iterdir()))


def test_eyas_source_without_a_fingerprint(files, tmp_path, monkeypatch):
    """A converted-GGUF record (eyas_source.json) that is valid JSON but holds no fingerprint: in eyas's own cache
    it is a stale entry that is converted again; in a folder the user passes it is one error line naming the file
    and the fix (never a KeyError)."""
    import eyas.target.load as tg
    from eyas.target.convert import file_fingerprint

    # a user's folder: one error line
    folder = tmp_path / "converted"
    shutil.copytree(files / "llama", folder)
    (folder / "eyas_source.json").write_text(json.dumps({"gguf": "/gone/model.gguf"}))
    line = _one_error(CliRunner().invoke(app, ["inspect", str(folder)]))
    assert "eyas_source.json records no 'fingerprint'" in line and "delete that file" in line, line
    (folder / "eyas_source.json").write_text("[1, 2]")  # valid JSON, not a record
    assert "records no 'fingerprint'" in _one_error(CliRunner().invoke(app, ["inspect", str(folder)]))

    # eyas's cache: the entry is judged stale and the GGUF converted again
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(gguf_bytes("llama"))
    fp = file_fingerprint([gguf])
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    entry = tmp_path / "cache" / "targets" / f"m-{fp.split(':')[1][:12]}"
    entry.mkdir(parents=True)
    (entry / "config.json").write_text("{}")
    for record, ok in [(None, False), ("{not json", False), ({"gguf": str(gguf)}, False),
                       ({"fingerprint": "sha256:other"}, False), ({"fingerprint": fp}, True)]:
        src = entry / "eyas_source.json"
        src.unlink(missing_ok=True)
        if record is not None:
            src.write_text(record if isinstance(record, str) else json.dumps(record))
        assert tg._cache_entry_ok(entry, fp) is ok, record
    (entry / "eyas_source.json").write_text(json.dumps({"gguf": str(gguf)}))
    converted = []

    def fake_convert(g, out):
        converted.append((g, out))
        raise tg.TargetError("stop here")  # the conversion itself is covered elsewhere

    monkeypatch.setattr(tg, "convert_gguf", fake_convert)
    with pytest.raises(tg.TargetError, match="stop here"):
        tg.load_target(str(gguf))
    assert converted == [(gguf, entry)]


# ---- disk faults: full, read-only, permission denied while writing -----------------------------------------

def _failing_save_file(code: int):
    """safetensors' save_file on a disk that gives out: some bytes land, then the OS error (without a filename,
    as a write deep inside a library reports it)."""
    import os

    def save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)
        raise OSError(code, os.strerror(code))

    return save_file


@pytest.fixture(scope="module")
def good_shards(files):
    out = files / "good-shards"
    r = CliRunner().invoke(app, ["datagen", "--data", str(files / "late.jsonl"), "--target", str(files / "llama"),
                                 "--out", str(out), "--no-regenerate", "--quiet", "--threads", "1"])
    assert r.exit_code == 0, r.output
    return out


def _disk_cases(r: Path, shards: Path) -> dict[str, tuple[list[str], str, str, Callable[[Path], list[Path]]]]:
    """name -> (argv, module whose save_file fails (eyas.files: save_safetensors, which shards and exports use), the
    file the error names, what must not be left behind)"""
    def datagen(out: Path) -> list[str]:
        return ["datagen", "--data", str(r / "late.jsonl"), "--target", str(r / "llama"), "--out", str(out),
                "--no-regenerate", "--quiet", "--threads", "1"]

    def train(out: Path) -> list[str]:
        return ["train", "--data", str(shards), "--out", str(out), "--draft-vocab", "64", "--ttt-steps", "2",
                "--batch-tokens", "512", "--max-len", "256", "--heldout-pct", "0", "--quiet", "--threads", "1"]

    def export(out: Path) -> list[str]:
        return ["export", "--draft", "default", "--format", "vllm", "--out", str(out)]

    def left_shards(out: Path) -> list[Path]:
        listed = json.loads((out / "manifest.json").read_text())["shards"] if (out / "manifest.json").exists() else []
        return [*out.glob("shard-*"), *out.glob("*.tmp-*")] + ([out / "manifest.json"] if listed else [])

    def left_checkpoint(out: Path) -> list[Path]:
        return [p for p in (out / "checkpoint.new", out / "checkpoint") if p.exists()]

    def left_export(out: Path) -> list[Path]:
        return [p for p in (out, *out.parent.glob(out.name + ".tmp-*")) if p.exists()]

    return {
        "datagen: disk full": (datagen(r / "df1"), "eyas.files", "shard-00000.safetensors", left_shards),
        "datagen: read-only": (datagen(r / "df2"), "eyas.files", "shard-00000.safetensors", left_shards),
        "train: disk full": (train(r / "tf1"), "eyas.train.checkpoint", "checkpoint.new", left_checkpoint),
        "train: permission denied": (train(r / "tf2"), "eyas.train.checkpoint", "checkpoint.new", left_checkpoint),
        "export: disk full": (export(r / "ef1"), "eyas.files", "ef1", left_export),
        "export: read-only": (export(r / "ef2"), "eyas.files", "ef2", left_export),
    }


DISK_FAULTS = {"disk full": (errno.ENOSPC, "no space left"), "read-only": (errno.EROFS, "read-only"),
               "permission denied": (errno.EACCES, "permission denied")}


@pytest.mark.parametrize("name", list(_disk_cases(Path("/x"), Path("/y"))))
def test_disk_fault_is_one_error_line_and_leaves_nothing_half_written(files, good_shards, monkeypatch, name):
    argv, module, named, leftovers = _disk_cases(files, good_shards)[name]
    code, phrase = DISK_FAULTS[name.split(": ", 1)[1]]
    monkeypatch.setattr(f"{module}.save_file", _failing_save_file(code))
    line = _one_error(CliRunner().invoke(app, argv))
    assert named in line and phrase in line and ".tmp-" not in line, line
    out = Path(argv[argv.index("--out") + 1])
    assert leftovers(out) == [], f"left for a rerun to trust: {leftovers(out)}"


@pytest.mark.asset
def test_the_bundled_draft_on_another_target_names_both_and_what_to_run(files):
    """--draft default (the default) on a user's own model: one line saying the draft belongs to smollm2-135m and
    what to run instead, from generate and from bench alike."""
    for argv in (["generate", "--target", str(files / "llama"), "--prompt", "hi", "--max-new-tokens", "2"],
                 ["bench", "--target", str(files / "llama"), "--methods", "tree", "--limit", "1",
                  "--max-new-tokens", "2", "--out", str(files / "bench-default")]):
        r = CliRunner().invoke(app, argv)
        lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
        assert r.exit_code == 2 and len(lines) == 1, r.output[-3000:]
        assert "the bundled draft was trained for smollm2-135m (llama, 30 layers" in lines[0], lines[0]
        assert "not for llama (llama, 4 layers" in lines[0], lines[0]
        assert "--method lookup" in lines[0] and "eyas train" in lines[0], lines[0]
