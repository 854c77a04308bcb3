"""eyas datagen on a tiny random Llama with the SmolLM2 tokenizer: shards that match an unpadded capture,
chunking, interrupts and resumes, rows it skips and says so, reruns refused or extended, CLI errors. The
regeneration tests are in tests/test_datagen_regen.py; the shared tiny target and conversations are
tests/conftest.py's tiny_dir, tiny_target and conv_file."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from eyas.cli import app
from eyas.data.capture import length_batches
from eyas.data.conversations import load_conversations, tokenize_conversation
from eyas.data.datagen import DatagenConfig, DatagenError, run_datagen
from eyas.data.shards import ShardSet, load_manifest
from eyas.target.capture import capture
from eyas.target.load import load_target

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()




def _save_tiny(path: Path, tokenizer, seed: int) -> Path:
    """A tiny random Llama with the real SmolLM2 tokenizer (vocab 49152), saved as a HF folder."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(cfg).eval()
    model.config.architectures = ["LlamaForCausalLM"]
    model.generation_config = tf.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _cfg(out, tiny_dir, conv_file, **kw):
    base = dict(out=str(out), target=str(tiny_dir), data=str(conv_file), max_len=96, regenerate=False,
                dtype="fp32", shard_samples=4, max_new_tokens=6)
    return DatagenConfig(**{**base, **kw})


def _args(cfg: DatagenConfig) -> list[str]:
    a = ["datagen", "--target", cfg.target, "--data", cfg.data, "--out", cfg.out, "--max-len", str(cfg.max_len),
         "--dtype", cfg.dtype, "--shard-samples", str(cfg.shard_samples), "--max-new-tokens", str(cfg.max_new_tokens),
         "--regenerate" if cfg.regenerate else "--no-regenerate", "--quiet", "--threads", "1"]
    if cfg.num is not None:
        a += ["--num", str(cfg.num)]
    return a


def test_length_batches():
    lens = [5, 100, 7, 6, 90, 8]
    b = length_batches(lens, max_batch=2, token_budget=1000)
    assert sorted(i for x in b for i in x) == list(range(6))
    assert b[0] == [0, 3] and all(len(x) <= 2 for x in b)
    b = length_batches(lens, max_batch=99, token_budget=20)
    assert all(len(x) * max(lens[i] for i in x) <= 20 or len(x) == 1 for x in b)


def test_datagen_writes_shards_matching_an_unpadded_capture(tmp_path, tiny_dir, tiny_target, conv_file):
    cfg = _cfg(tmp_path / "out", tiny_dir, conv_file, num=11, shard_tokens=150)
    m = run_datagen(cfg, command="test", progress=False, log=lambda s: None)
    assert m["kind"] == "eyas-shards" and m["complete"] and m["target_source"] == str(tiny_dir)
    assert m["layout"]["aux_indices"] == [2, 4, 5]  # EAGLE-3 default for 8 layers
    assert set(m["layout"]["norms"]) == {"2", "4", "5", "final"}
    assert m["layout"]["target"]["fingerprint"] == tiny_target.identity.fingerprint
    assert m["config"]["max_len"] == 96 and m["config"]["regenerate"] is False and m["config"]["dtype"] == "fp32"
    assert m["skipped"] == {"no_assistant_turn": 1, "invalid_json": 1}
    assert m["counts"]["conversations"] == 11 and m["counts"]["rows"] == 13 and m["watermark"] == 12
    assert len(m["shards"]) > 3  # split by shard_tokens
    ss = ShardSet(tmp_path / "out")
    samples = list(ss.samples())
    assert [s.row_id for s in samples] == [r for r in range(13) if r not in (5, 11)]
    assert m["counts"]["tokens"] == sum(len(s) for s in samples) == ss.num_tokens
    convs = {c.row_id: c for c in load_conversations(str(conv_file), num=11)[0]}
    tok = tiny_target.tokenizer
    for s in samples:
        ids, mask = tokenize_conversation(tok, convs[s.row_id].messages, max_len=96)
        assert torch.equal(s.input_ids, ids) and torch.equal(s.loss_mask, mask)
        assert s.aux.shape == (len(s), 3 * 32) and s.final.shape == (len(s), 32) and s.aux.dtype == torch.float32
        ref = capture(tiny_target.model, ids[None], m["layout"]["aux_indices"])  # alone, no padding
        assert torch.allclose(s.aux, ref.aux[0], atol=1e-4) and torch.allclose(s.final, ref.final_prenorm[0], atol=1e-4)
    expect = ref.aux[0].view(len(ids), 3, 32).norm(dim=-1).mean(0)  # sanity: norms are per-token L2 means
    assert all(v > 0 for v in m["layout"]["norms"].values()) and expect.shape == (3,)


def test_first_chunks_are_small_so_a_new_run_commits_early(conv_file, tiny_dir):
    from eyas.data.chunks import FIRST_CHUNK, chunk_size, iter_chunks

    cfg = _cfg("unused", tiny_dir, conv_file, shard_samples=64)
    assert [chunk_size(cfg, k) for k in range(5)] == [FIRST_CHUNK, 2 * FIRST_CHUNK, 4 * FIRST_CHUNK, 64, 64]
    sizes = [len(c) for c, *_ in iter_chunks(cfg, -1, 30, chunks_done=0)]
    assert sizes[:2] == [8, 16] and sum(sizes) == 30
    # a resumed folder continues the schedule from its committed chunks, so its chunks are an uninterrupted run's
    assert [len(c) for c, *_ in iter_chunks(cfg, -1, 30, chunks_done=2)][0] == 30  # 32 asked, 30 left


def _running_past_its_first_shard(cfg: DatagenConfig) -> subprocess.Popen:
    """`eyas datagen` for cfg in a process of its own, returned once its first shard is committed (still running)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "eyas", *_args(cfg)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            if load_manifest(Path(cfg.out))["shards"]:
                break
        except (OSError, ValueError, KeyError):
            pass  # not written yet, or being replaced right now
        time.sleep(0.01)
    assert proc.poll() is None, f"datagen ended before it could be stopped: {proc.stderr.read().decode()[-2000:]}"
    return proc


@pytest.mark.slow
def test_sigterm_says_what_is_committed_and_the_rerun_completes_it(tmp_path, tiny_dir, tiny_target, conv_file):
    cfg = _cfg(tmp_path / "stopped", tiny_dir, conv_file, regenerate=True, max_new_tokens=8, shard_samples=1,
               max_len=96, num=30)
    proc = _running_past_its_first_shard(cfg)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1].decode()
    stopped = load_manifest(tmp_path / "stopped")
    said = " ".join(err.split())
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert (f"stopped by SIGTERM; {stopped['counts']['conversations']} conversations in {len(stopped['shards'])} "
            f"shards are committed in {tmp_path / 'stopped'}") in said and "Resume with: eyas datagen" in said, said
    res = runner.invoke(app, _args(cfg))  # the command it names
    assert res.exit_code == 0, res.output
    done = load_manifest(tmp_path / "stopped")
    assert done["complete"] and done["counts"]["conversations"] == 30


@pytest.mark.slow
def test_resume_after_sigkill_loses_and_duplicates_nothing(tmp_path, tiny_dir, tiny_target, conv_file):
    cfg = _cfg(tmp_path / "killed", tiny_dir, conv_file, regenerate=True, max_new_tokens=8, shard_samples=1,
               max_len=96, num=30)
    proc = _running_past_its_first_shard(cfg)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = load_manifest(tmp_path / "killed")
    assert not killed["complete"] and 1 <= len(killed["shards"])
    # a kill between the shard rename and the manifest rename leaves a shard file the manifest does not list
    orphan = tmp_path / "killed" / f"shard-{len(killed['shards']):05d}.safetensors"
    orphan.write_bytes((tmp_path / "killed" / killed["shards"][0]["file"]).read_bytes())
    res = runner.invoke(app, _args(cfg))  # the same command again
    assert res.exit_code == 0, res.output
    assert "never committed" in res.output

    full = run_datagen(_cfg(tmp_path / "full", tiny_dir, conv_file, regenerate=True, max_new_tokens=8,
                            shard_samples=1, max_len=96, num=30), command="test", progress=False, log=lambda s: None)
    resumed = load_manifest(tmp_path / "killed")
    a = list(ShardSet(tmp_path / "killed").samples())
    b = list(ShardSet(tmp_path / "full").samples())
    ids_a, ids_b = [s.row_id for s in a], [s.row_id for s in b]
    assert len(ids_a) == len(set(ids_a)) and ids_a == ids_b == sorted(ids_b)
    assert len(ids_b) == 30
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        assert torch.allclose(x.aux, y.aux, atol=1e-5)
    for k in ("samples", "tokens", "loss_tokens", "conversations", "rows", "regenerated_tokens"):
        assert resumed["counts"][k] == full["counts"][k], k
    assert resumed["skipped"] == full["skipped"] and resumed["complete"]
    assert len(resumed["commands"]) == 2


def test_num_extends_a_run(tmp_path, tiny_dir, conv_file):
    cfg = _cfg(tmp_path / "out", tiny_dir, conv_file, num=3)
    run_datagen(cfg, command="a", progress=False, log=lambda s: None)
    cfg.num = 7
    m = run_datagen(cfg, command="b", progress=False, log=lambda s: None)
    ids = [s.row_id for s in ShardSet(tmp_path / "out").samples()]
    assert ids == [0, 1, 2, 3, 4, 6, 7] and m["counts"]["conversations"] == 7 and m["commands"] == ["a", "b"]
    logs = []
    m2 = run_datagen(cfg, command="c", progress=False, log=logs.append)
    assert "resuming" in logs[0] and "nothing to do" in logs[1] and m2["shards"] == m["shards"]


def test_the_first_committed_chunk_estimates_the_rest(tmp_path, tiny_dir, conv_file):
    """Once the first chunk of a run is committed, one line says how long the remaining conversations take at the
    rate measured so far; a run that one chunk completes says nothing of the kind."""
    logs: list[str] = []
    run_datagen(_cfg(tmp_path / "out", tiny_dir, conv_file, num=10), command="a", progress=False, log=logs.append)
    said = [line for line in logs if "take about" in line]
    assert len(said) == 1 and "4 of 10 conversations committed" in said[0] and "remaining 6" in said[0], logs
    assert "rerun the same command to resume" in said[0]
    logs.clear()
    run_datagen(_cfg(tmp_path / "small", tiny_dir, conv_file, num=4), command="a", progress=False, log=logs.append)
    assert not [line for line in logs if "take about" in line], logs


def test_a_rerun_says_it_resumes_and_from_where(tmp_path, tiny_dir, conv_file):
    run_datagen(_cfg(tmp_path / "out", tiny_dir, conv_file, num=3), command="a", progress=False, log=lambda s: None)
    logs: list[str] = []
    run_datagen(_cfg(tmp_path / "out", tiny_dir, conv_file, num=5), command="b", progress=False, log=logs.append)
    assert any(line.startswith(f"resuming {tmp_path / 'out'}: 3 conversations in 1 shards are committed")
               for line in logs), logs


def test_duration_reads_as_a_person_would():
    from eyas.text import duration

    assert [duration(s) for s in (45, 600, 12_600)] == ["45 s", "10 min", "3.5 h"]


def test_rows_that_are_not_utf8_are_skipped_listed_and_said(tmp_path, tiny_dir):
    """Two rows with bytes that are not UTF-8 (ids 2 and 9): skipped, counted, their ids listed in the manifest
    across a resume (no duplicate) and named in the summary; the other rows are captured as usual."""
    good = [json.dumps({"conversations": [{"from": "human", "value": f"Say {i}."},
                                          {"from": "gpt", "value": f"{i}."}]}).encode() for i in range(12)]
    rows = [b.replace(b"Say", b"S\xe4y") if i in (2, 9) else b for i, b in enumerate(good)]
    data = tmp_path / "convs.jsonl"
    data.write_bytes(b"\n".join(rows) + b"\n")
    cfg = _cfg(tmp_path / "out", tiny_dir, data, num=3, shard_samples=2)
    r = runner.invoke(app, _args(cfg))
    assert r.exit_code == 0, r.output
    assert "row ids 2;" in r.output  # the first run (rows 0-3) already met one
    cfg.num = 20
    r = runner.invoke(app, _args(cfg))
    assert r.exit_code == 0, r.output
    m = load_manifest(tmp_path / "out")
    assert m["skipped"] == {"invalid_utf8": 2} and m["skipped_rows"] == {"invalid_utf8": [2, 9]}
    assert "skipped 2 row(s) as invalid_utf8 (row ids 2, 9;" in r.output and "re-save the source as UTF-8" in r.output
    assert [s.row_id for s in ShardSet(tmp_path / "out").samples()] == [i for i in range(12) if i not in (2, 9)]


def test_start_row_reads_only_later_rows_and_is_fixed_for_the_folder(tmp_path, tiny_dir, conv_file):
    cfg = _cfg(tmp_path / "out", tiny_dir, conv_file, num=3, start_row=6)
    m = run_datagen(cfg, command="a", progress=False, log=lambda s: None)
    ids = [s.row_id for s in ShardSet(tmp_path / "out").samples()]
    assert ids == [6, 7, 8] and m["config"]["start_row"] == 6 and m["watermark"] == 8  # row 11 (broken) not reached
    cfg.num = 5  # extending resumes after the watermark
    run_datagen(cfg, command="b", progress=False, log=lambda s: None)
    assert [s.row_id for s in ShardSet(tmp_path / "out").samples()] == [6, 7, 8, 9, 10]
    res = runner.invoke(app, _args(cfg) + ["--start-row", "0"])  # the same folder from another row: refused
    assert res.exit_code == 2 and "start_row: existing 6, this run 0" in res.output, res.output
    with pytest.raises(DatagenError, match="--start-row must be >= 0"):
        _cfg(tmp_path / "o2", tiny_dir, conv_file, start_row=-1).validate()
    bounded = _cfg(tmp_path / "o3", tiny_dir, conv_file, num=5, start_row=6, end_row=8)  # another folder starts at 8
    m = run_datagen(bounded, command="c", progress=False, log=lambda s: None)
    assert [s.row_id for s in ShardSet(tmp_path / "o3").samples()] == [6, 7] and m["watermark"] == 7
    assert m["complete"]
    with pytest.raises(DatagenError, match=r"--end-row must be > --start-row \(6\), got 6"):
        _cfg(tmp_path / "o4", tiny_dir, conv_file, start_row=6, end_row=6).validate()


def test_mismatched_rerun_is_refused(tmp_path, tiny_dir, conv_file, smollm2_tokenizer):
    cfg = _cfg(tmp_path / "out", tiny_dir, conv_file, num=2)
    assert runner.invoke(app, _args(cfg)).exit_code == 0
    for extra, field in [(["--max-len", "80"], "max_len"), (["--aux-indices", "1,2,3"], "aux_indices"),
                         (["--regenerate"], "regenerate"), (["--dtype", "bf16"], "dtype")]:
        res = runner.invoke(app, _args(cfg) + extra)
        assert res.exit_code == 2, res.output
        assert field in res.output and "refusing" in res.output, res.output
    other = _save_tiny(tmp_path / "other", smollm2_tokenizer, seed=1)
    res = runner.invoke(app, _args(cfg) + ["--target", str(other)])
    assert res.exit_code == 2 and "target.fingerprint" in res.output, res.output
    other_data = tmp_path / "other.jsonl"
    other_data.write_text(conv_file.read_text().replace("a", "b", 1))
    res = runner.invoke(app, _args(cfg) + ["--data", str(other_data)])
    assert res.exit_code == 2 and "source" in res.output, res.output


def test_cli_errors_are_clean(tmp_path, tiny_dir):
    csv = tmp_path / "x.csv"
    csv.write_text("a,b\n1,2\n")
    res = runner.invoke(app, ["datagen", "--target", str(tiny_dir), "--data", str(csv), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "not a conversation file" in res.output
    res = runner.invoke(app, ["datagen", "--target", str(tiny_dir), "--data", str(csv), "--out", str(tmp_path / "o"),
                              "--dtype", "int8"])
    assert res.exit_code == 2 and "int8" in res.output


def test_inspect_reads_the_shard_folder(tmp_path, tiny_dir, conv_file):
    cfg = _cfg(tmp_path / "out", tiny_dir, conv_file, num=2)
    res = runner.invoke(app, _args(cfg))
    assert res.exit_code == 0 and "bytes/token" in res.output and "skipped" in res.output
    res = runner.invoke(app, ["inspect", str(tmp_path / "out"), "--json"])
    info = json.loads(res.output)
    assert info["kind"] == "eyas-shards" and info["counts"]["samples"] == 2


def test_fp16_overflow_is_loud(tmp_path, tiny_dir, conv_file):
    t = load_target(str(tiny_dir))
    with torch.no_grad():
        t.model.model.embed_tokens.weight.mul_(1e6)  # a residual stream far beyond fp16's 65504
    cfg = _cfg(tmp_path / "out", tiny_dir, conv_file, num=2, dtype="fp16")
    with pytest.raises(DatagenError, match="overflow"):
        run_datagen(cfg, command="t", progress=False, log=lambda s: None, target=t)


# ---- the real bundled target ------------------------------------------------------------------------

@pytest.mark.integration
def test_smollm2_sharegpt_layout_and_shapes(tmp_path, smollm2):
    cfg = DatagenConfig(out=str(tmp_path / "o"), data="sharegpt", num=3, max_len=96, regenerate=False)
    m = run_datagen(cfg, command="t", progress=False, log=lambda s: None, target=smollm2)
    assert m["layout"]["aux_indices"] == [2, 15, 27] and m["target_source"] == "smollm2-135m"
    assert m["layout"]["target"]["num_layers"] == 30 and m["config"]["dtype"] == "bf16"
    norms = m["layout"]["norms"]
    assert set(norms) == {"2", "15", "27", "final"} and norms["27"] > norms["2"]
    samples = list(ShardSet(tmp_path / "o").samples())
    assert [s.row_id for s in samples] == [0, 1, 2]
    for s in samples:
        assert len(s) == 96 and s.aux.shape == (96, 3 * 576) and s.final.shape == (96, 576)
        assert s.aux.dtype == torch.bfloat16 and s.loss_mask.any()
    ref = capture(smollm2.model, samples[0].input_ids[None], [2, 15, 27])
    assert torch.allclose(samples[0].aux.float(), ref.aux[0], rtol=1e-2, atol=1e-1)


def test_zero_samples_is_an_error_but_a_resumed_run_that_has_samples_is_not(tmp_path, tiny_dir, conv_file):
    good = conv_file.read_text().splitlines()[0]
    unanswered = json.dumps({"conversations": [{"from": "human", "value": "hello?"}]})
    data = tmp_path / "mixed.jsonl"
    data.write_text("\n".join([good, unanswered, unanswered]) + "\n")
    quiet = dict(progress=False, log=lambda s: None)
    m = run_datagen(_cfg(tmp_path / "out", tiny_dir, data, num=1), command="a", **quiet)
    assert m["counts"]["samples"] == 1
    # the rest of the source is all skipped rows: this run adds nothing, the folder still holds a sample
    m = run_datagen(_cfg(tmp_path / "out", tiny_dir, data), command="b", **quiet)
    assert m["counts"]["samples"] == 1 and m["skipped"] == {"no_assistant_turn": 2} and m["complete"]
    # the same rows alone: nothing to train on, named by reason; the manifest still records what was read
    only = tmp_path / "only.jsonl"
    only.write_text("\n".join([unanswered] * 3) + "\n")
    with pytest.raises(DatagenError, match=r"no samples: all 3 source rows .* \(no_assistant_turn 3; "):
        run_datagen(_cfg(tmp_path / "zero", tiny_dir, only), command="c", **quiet)
    man = load_manifest(tmp_path / "zero")
    assert man["complete"] and man["skipped"] == {"no_assistant_turn": 3} and man["counts"]["rows"] == 3
    with pytest.raises(DatagenError, match="no samples"):  # a rerun of it is still the same failure
        run_datagen(_cfg(tmp_path / "zero", tiny_dir, only), command="d", **quiet)


def test_a_rerun_with_a_changed_flag_names_that_flag_only(tmp_path, tiny_dir, conv_file):
    run_datagen(_cfg(tmp_path / "d", tiny_dir, conv_file, num=2), command="test", progress=False, log=lambda s: None)
    with pytest.raises(DatagenError) as e:
        run_datagen(_cfg(tmp_path / "d", tiny_dir, conv_file, num=2, max_len=64), command="test", progress=False,
                    log=lambda s: None)
    said = str(e.value)
    assert "max_len: existing 96, this run 64" in said and "target_source was" not in said, said
