"""eyas doctor serving against SGLang, through a stand-in server that answers exactly what SGLang 0.5.23's
OpenAI-compatible protocol defines (no SGLang with EAGLE-3 runs on this CPU: its EAGLE path needs Intel AMX).

The stand-in (read in the 0.5.23 wheel, python/sglang/srt/; nothing copied):
- GET /server_info: the resolved server args, flat, plus `version` and `launch_command`
  (entrypoints/http_server.py `server_info` ~line 863 -> utils/common.py `build_server_info` line 3584 ->
  ServerArgs.resolved_dict, server_args.py line 316); `/get_server_info` is its deprecated alias (line 853); no
  GET /version (vLLM's, vllm/entrypoints/serve/instrumentator/basic.py); GET /v1/models lists the served name
  (http_server.py line 1993).
- POST /v1/completions: CompletionRequest (entrypoints/openai/protocol.py line 365: `prompt` a token-id list, line
  372; `return_spec_tokens_details` line 393; `return_token_ids`; unknown fields ignored, pydantic's default);
  the answer is CompletionResponse (line 528) with choices[].token_ids only when return_token_ids (line 513,
  serving_completions.py line 622) and `sglext` only when it holds something (line 536-543, SglExt line 470
  dropping None fields), `sglext.spec_tokens_details` one SpecTokensDetails object for n = 1 (protocol.py line
  456; serving_completions.py 548-572) built by utils.py `spec_tokens_details_from_meta_info` (line 310).
- the counts: managers/tokenizer_manager.py `_calculate_spec_decoding_metrics` (line 3138) fills them only when
  spec_verify_ct > 0, spec_num_proposed_drafts = spec_verify_ct * (num_draft_tokens - 1), the histogram only when
  non-empty; managers/scheduler_components/batch_result_processor.py lines 819-836 count one verify round per
  decode step of an unfinished request, its accepted drafts (bonus excluded) into histogram bin j (grown to the
  largest j seen: schedule_batch.py line 1566), the prefill's token none (process_batch_result_prefill, line 258).
The stand-in's counts are eyas's own replay of the draft under SGLang's flags, per request, so the right server
passes exactly; its plants: a bin off by one, a server that accepts nothing, a planted wiring fault's counts,
a num_draft_tokens other than the one it reports."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from typer.testing import CliRunner

from eyas.cli import app
from eyas.doctor.server import ServerClient, ServingError
from eyas.doctor.serving import render_serving
from eyas.doctor.sglang_counts import check_sglang, histogram_of, per_pos_of, resolve_shape
from eyas.replay.plants import FAULTS
from eyas.replay.rows import capture_rows_eyas, plant_streams
from eyas.replay.run import replay, sglang
from tests.test_engine import PROMPTS, make_target, prompts_for_training, train_draft

NEW = 24  # max_tokens per request
SHAPE = (3, 1, 4)  # steps, topk, num_draft_tokens as SGLang runs them (topk 1: steps + 1)
LAUNCH = ["python", "-m", "sglang.launch_server", "--model-path", "T", "--speculative-algorithm", "EAGLE3",
          "--speculative-draft-model-path", "D", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
          "--speculative-num-draft-tokens", "16"]  # 16 rewritten to 4 by SGLang (speculative_hook.py ~line 1255)


@pytest.fixture(scope="module")
def tiny():
    return make_target()


@pytest.fixture(scope="module")
def trained(tiny):
    return train_draft(tiny)


@pytest.fixture(scope="module")
def rows(tiny, trained):
    return capture_rows_eyas(tiny, PROMPTS + prompts_for_training(2, seed=11), 30,
                             plant_streams(trained.layout.aux_indices, tiny.num_layers))


def server_info(steps: int, topk: int, ntok: int, algo: str | None = "EAGLE3") -> dict:
    """The /server_info fields eyas reads, with a few of the others a 0.5.23 server sends alongside."""
    return {"model_path": "/models/tiny", "speculative_algorithm": algo, "speculative_draft_model_path": "/d",
            "speculative_num_steps": steps, "speculative_eagle_topk": topk, "speculative_num_draft_tokens": ntok,
            "tp_size": 1, "page_size": 1, "launch_command": "--model-path /models/tiny", "version": "0.5.23",
            "frontend": "python", "internal_states": [{}]}


def details(per_pos: list[int], rounds: int, ntok: int, completion_tokens: int) -> dict | None:
    """One request's SpecTokensDetails as 0.5.23 fills it (None when no verify round ran: no sglext at all)."""
    if rounds == 0:
        return None
    proposed, correct = rounds * (ntok - 1), sum(per_pos)
    return {"spec_accept_rate": correct / proposed, "spec_accept_length": completion_tokens / rounds,
            "spec_cap_length": 0.0, "spec_block_accept_length": 0.0, "spec_num_correct_drafts": correct,
            "spec_num_proposed_drafts": proposed, "spec_verify_ct": rounds,
            "spec_correct_drafts_histogram": histogram_of(per_pos, rounds), "spec_cap_lens_histogram": []}


class _SGLang(BaseHTTPRequestHandler):
    """SGLang 0.5.23's answers to the requests doctor serving makes; what it counts is set on the server."""

    def _send(self, code: int, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802 - the stdlib's name
        if self.path in ("/server_info", "/get_server_info") and self.server.info is not None:
            return self._send(200, self.server.info)
        if self.path == "/v1/models":
            return self._send(200, {"object": "list", "data": [{"id": "tiny", "object": "model", "created": 0,
                                                                "owned_by": "sglang", "root": "tiny"}]})
        self._send(404, {"detail": "Not Found"})

    def do_POST(self):  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions":
            return self._send(404, {"detail": "Not Found"})
        prompt = req["prompt"]
        assert isinstance(prompt, list) and all(isinstance(t, int) for t in prompt), prompt  # List[int]: input_ids
        assert req["temperature"] == 0.0 and req["max_tokens"] == self.server.new_tokens, req
        self.server.seen.append(req)
        toks, det = self.server.answers[tuple(prompt)]
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "matched_stop": None}
        if req.get("return_token_ids"):
            choice |= {"token_ids": toks, "prompt_token_ids": prompt}
        out = {"id": "1", "object": "text_completion", "created": 0, "model": req.get("model", "default"),
               "choices": [choice], "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(toks),
                                              "total_tokens": len(prompt) + len(toks)}, "metadata": None}
        if req.get("return_spec_tokens_details") and det is not None:
            out["sglext"] = {"spec_tokens_details": det}
        self._send(200, out)

    def log_message(self, *a):
        pass


@pytest.fixture
def stand_in():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _SGLang)
    srv.info, srv.answers, srv.seen, srv.new_tokens = server_info(*SHAPE), {}, [], NEW
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.shutdown()
    srv.server_close()


def answers_from_replay(rows, tiny, ck, shape=SHAPE, plant=None, reported_ntok: int | None = None) -> dict:
    """Per prompt: the rows' reply and the counts eyas's replay of `ck` (a fault planted) gives that request."""
    res = replay(rows, tiny, ck, sglang(*shape), NEW, plant=plant)
    out = {}
    for i, r in enumerate(res.rows):
        toks = rows.reply(i, NEW)
        out[tuple(rows.prompt(i))] = (toks, details(r.per_pos, r.rounds, reported_ntok or shape[2], len(toks)))
    return out


def run_check(srv, tiny, trained, rows, **kw):
    from eyas.doctor.server import ServerClient

    cl = ServerClient(srv.url)
    try:
        answer = cl.engine()
    finally:
        cl.close()
    rep = check_sglang(srv.url, tiny, trained, rows, answer, max_new_tokens=NEW, **kw)
    lines: list[str] = []
    render_serving(rep, lines.append)
    return rep, "\n".join(lines)


def test_histogram_and_per_position_counts_are_one_another():
    assert histogram_of([5, 3, 1], 10) == [5, 2, 2, 1]
    assert per_pos_of([5, 2, 2, 1], 3) == [5, 3, 1]
    assert histogram_of([4, 0, 0], 9) == [5, 4]  # SGLang grows the list only to the largest j seen
    assert per_pos_of([5, 4], 3) == [4, 0, 0]
    assert histogram_of([0, 0], 7) == [7]


def test_engine_detection(stand_in):
    cl = ServerClient(stand_in.url)
    a = cl.engine()
    assert (a.name, a.version, a.how) == ("sglang", "0.5.23", "GET /server_info") and "SGLang 0.5.23" in a.line()
    stand_in.info = None
    assert cl.engine().name == "unknown"  # neither engine's page: read as vLLM by its /metrics, which says why
    cl.close()


def test_shape_comes_from_the_server_and_the_launch_command_must_agree():
    info = server_info(*SHAPE)
    assert resolve_shape(info, None, None).flags() == "3,1,4"
    assert resolve_shape(info, LAUNCH, None).flags() == "3,1,4"  # 16 draft tokens, as SGLang runs them: 4
    assert resolve_shape(None, LAUNCH, None).source == "the launch command"
    assert resolve_shape(None, None, "3,4,8").flags() == "3,4,8"
    with pytest.raises(ServingError, match="the server's /server_info says it runs 3, 1, 4") as e:
        resolve_shape(info, None, "3,4,8")
    assert "\n" not in str(e.value)
    with pytest.raises(ServingError, match="pass --sglang"):
        resolve_shape(None, None, None)
    with pytest.raises(ServingError, match="starts vLLM"):
        resolve_shape(None, ["vllm", "serve", "m", "--speculative-config", "{}"], None)


def test_the_right_server_passes_exactly(stand_in, tiny, trained, rows):
    stand_in.answers = answers_from_replay(rows, tiny, trained)
    rep, text = run_check(stand_in, tiny, trained, rows, command=LAUNCH)
    assert rep.verdict.status == "pass", text
    assert rep.verdict.line.startswith("the server's accepted-draft histogram") and "exactly" in rep.verdict.line
    assert rep.engine == "sglang" and rep.sglang["num_draft_tokens"] == 4 and rep.same_tokens == len(rows)
    assert rep.server["histogram"] == rep.replay["histogram"] and sum(rep.server["per_pos"]) > 0
    assert rep.server["num_proposed_drafts"] == rep.replay["num_proposed_drafts"] == rep.server["verify_ct"] * 3
    assert "PASS: " in text and "SGLang 0.5.23: steps 3, topk 1, num_draft_tokens 4" in text
    assert all(r["return_spec_tokens_details"] and r["return_token_ids"] for r in stand_in.seen)
    assert rep.plants == {}  # nothing to diagnose


def test_a_tree_shape_passes_too(stand_in, tiny, trained, rows):
    shape = (2, 2, 4)
    stand_in.info = server_info(*shape)
    stand_in.answers = answers_from_replay(rows, tiny, trained, shape)
    rep, text = run_check(stand_in, tiny, trained, rows)
    assert rep.verdict.status == "pass", text


def _plant_bin(answers: dict, j: int, delta: int) -> dict:
    """One request's histogram bin j moved by delta (its other fields as they were)."""
    out = dict(answers)
    key = next(k for k, (_, d) in answers.items() if d and len(d["spec_correct_drafts_histogram"]) > j
               and d["spec_correct_drafts_histogram"][j] + delta >= 0)
    toks, d = answers[key]
    h = list(d["spec_correct_drafts_histogram"])
    h[j] += delta
    out[key] = (toks, {**d, "spec_correct_drafts_histogram": h})
    return out


def test_one_bin_off_by_one_fails(stand_in, tiny, trained, rows):
    right = answers_from_replay(rows, tiny, trained)
    stand_in.answers = _plant_bin(right, 1, +1)  # one round more accepting one draft: position 0 is one higher
    rep, text = run_check(stand_in, tiny, trained, rows)
    assert rep.verdict.status == "fail" and "must be equal" in rep.verdict.line, text
    assert "nearest fault" in rep.verdict.line and set(rep.plants) == {f.name for f in FAULTS}
    # bin 0 one lower: the per-position counts still agree, the histogram does not
    stand_in.answers = _plant_bin(right, 0, -1)
    rep, text = run_check(stand_in, tiny, trained, rows)
    assert rep.verdict.status == "fail" and "not self-consistent" in rep.verdict.line, text
    for v in (rep.verdict,):
        assert "\n" not in v.line


def test_a_server_that_accepts_nothing_is_d2t_or_an_untrained_draft(stand_in, tiny, trained, rows):
    ans = {}
    for i in range(len(rows)):  # every round commits only its bonus token: rounds = reply length - 1
        toks = rows.reply(i, NEW)
        ans[tuple(rows.prompt(i))] = (toks, details([0, 0, 0], len(toks) - 1, SHAPE[2], len(toks)))
    stand_in.answers = ans
    rep, text = run_check(stand_in, tiny, trained, rows)
    assert rep.server["histogram"] == [rep.server["verify_ct"]], text
    assert rep.verdict.status == "fail" and "nothing accepted" in rep.verdict.line and "vocab map (d2t)" in \
        rep.verdict.line and "--export" in rep.verdict.line, text


def test_a_planted_wiring_fault_is_named(stand_in, tiny, trained, rows):
    fault = next(f for f in FAULTS if f.name == "aux_ids_minus_1")
    stand_in.answers = answers_from_replay(rows, tiny, trained, plant=fault.plant)
    rep, text = run_check(stand_in, tiny, trained, rows)
    assert rep.verdict.status == "fail" and "one below the trained ones" in rep.verdict.line, text
    assert rep.reproduced_by == "aux_ids_minus_1" and "<- reproduces the server's counts" in text


def test_the_algorithm_is_named_and_a_shape_the_counts_deny_is_refused(stand_in, tiny, trained, rows):
    stand_in.info = server_info(*SHAPE, algo="EAGLE")
    fault = next(f for f in FAULTS if f.name == "aux_ids_plus_1")
    stand_in.answers = answers_from_replay(rows, tiny, trained, plant=fault.plant)
    rep, _ = run_check(stand_in, tiny, trained, rows)
    assert rep.verdict.status == "fail" and any("speculative_algorithm EAGLE" in n for n in rep.notes)
    stand_in.info = server_info(*SHAPE)
    stand_in.answers = answers_from_replay(rows, tiny, trained, reported_ntok=8)  # counts of 8 tokens per round
    with pytest.raises(ServingError, match="verifies 8 tokens per round"):
        run_check(stand_in, tiny, trained, rows)
    stand_in.info = server_info(*SHAPE, algo=None)
    with pytest.raises(ServingError, match="without speculative decoding"):
        run_check(stand_in, tiny, trained, rows)


def test_no_details_at_all_is_one_line(stand_in, tiny, trained, rows):
    stand_in.answers = {k: (t, None) for k, (t, _) in answers_from_replay(rows, tiny, trained).items()}
    with pytest.raises(ServingError, match="no response carried sglext.spec_tokens_details") as e:
        run_check(stand_in, tiny, trained, rows)
    assert "\n" not in str(e.value)


def test_cli_against_the_stand_in(stand_in, tiny, trained, rows, tmp_path):
    """The command as a user types it: the engine said, vLLM's --k refused, the check run from saved rows."""
    import copy

    from eyas.draft import save_draft
    from eyas.replay.rows import save_rows

    r = CliRunner().invoke(app, ["doctor", "serving", "--url", stand_in.url, "--draft", "default", "--k", "3"])
    assert r.exit_code == 2 and "--k is vLLM's" in r.output, r.output
    from eyas.target.load import load_target

    folder = tmp_path / "target"
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    saved = load_target(str(folder))  # its fingerprint is the folder's: rows captured from it
    rows = capture_rows_eyas(saved, [rows.prompt(i) for i in range(len(rows))], 30,
                             plant_streams(trained.layout.aux_indices, saved.num_layers))
    ck = copy.deepcopy(trained)
    ck.layout.target = saved.identity  # the same weights, recorded under the folder's fingerprint
    save_draft(tmp_path / "draft", ck.model, ck.layout)
    save_rows(rows, tmp_path / "rows")
    stand_in.answers = answers_from_replay(rows, saved, ck)
    r = CliRunner().invoke(app, ["doctor", "serving", "--url", stand_in.url, "--draft", str(tmp_path / "draft"),
                                 "--target", str(folder), "--rows", str(tmp_path / "rows"), "--max-new-tokens",
                                 str(NEW), "--prompts", str(len(rows))])
    assert r.exit_code == 0, r.output
    assert "SGLang 0.5.23 (GET /server_info)" in r.output and "PASS: the server's accepted-draft histogram" in r.output
