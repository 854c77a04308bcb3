"""eyas doctor serving: the Prometheus reader, the verdict on synthetic counters, the one-line errors (a closed
port, a server that is not vLLM), and, with vLLM installed, three real `vllm serve` processes: the right export
passes, an export with aux ids shifted by one and one without d2t fail with the cause named."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eyas.cli import app
from eyas.doctor.server import ServerClient, ServingError, SpecCounters, parse_prometheus, spec_counters
from eyas.doctor.serving import ExportFacts, judge

# what vLLM 0.32 writes (vllm/v1/spec_decode/metrics.py SpecDecodingProm): counters with _total, a model_name and
# an engine label, one per-position series per draft position; two engines here (data parallel) to be summed
VLLM_METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 100.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 20.0
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 300.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 60.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 90.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 50.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="1"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="2"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="m",position="0"} 1.7e+09
vllm:generation_tokens_total{engine="0",model_name="m"} 2.5e+02
vllm:prompt_tokens_total{engine="0",model_name="m"} 1e3
vllm:num_requests_running{engine="0",model_name="m"} NaN
"""


def test_prometheus_text_is_parsed_and_summed_over_engines():
    s = parse_prometheus(VLLM_METRICS + 'weird{label="a \\"quoted\\" b",m="Modèle\\\\x\\n"} 1\nnot a sample\n')
    assert s["weird"] == [({"label": 'a "quoted" b', "m": "Modèle\\x\n"}, 1.0)]
    c = spec_counters(VLLM_METRICS)
    assert (c.drafts, c.draft_tokens, c.accepted) == (120, 360, 100)
    assert c.per_pos == [56, 33, 11] and c.k == 3  # the _created series is not a count
    assert c.generation_tokens == 250 and c.prompt_tokens == 1000
    d = c.minus(SpecCounters(20, 60, 10, [6, 3, 1], 0, 0))
    assert d.per_pos == [50, 30, 10] and d.drafts == 100 and abs(d.tau() - 1.9) < 1e-9
    with pytest.raises(ServingError, match="restarted"):
        c.minus(SpecCounters(0, 0, 0, [0, 0], 0, 0))


@pytest.mark.parametrize("text, says", [
    ("<html><body>hello</body></html>", "not Prometheus text"),
    ("# TYPE sglang:spec_accept_length gauge\nsglang:spec_accept_length{model_name=\"m\"} 1.9\n", "SGLang"),
    ("# TYPE eyas_requests_total counter\neyas_requests_total 3\n", "no vllm:\\* metrics"),
    ("vllm:num_requests_running{engine=\"0\"} 0\n", "without speculative decoding"),
])
def test_pages_that_are_not_a_speculating_vllm_are_one_clear_line(text, says):
    with pytest.raises(ServingError, match=says) as e:
        spec_counters(text, "http://h:1")
    assert "\n" not in str(e.value)


def counters(per_pos, drafts, gen=None) -> SpecCounters:
    return SpecCounters(drafts, drafts * len(per_pos), sum(per_pos), list(per_pos), None, gen)


def test_verdict_on_synthetic_counters():
    right = ([40, 20, 10], 100)
    plants = {"aux_ids_minus_1": ([39, 19, 11], 101), "aux_ids_plus_1": ([10, 2, 0], 140),
              "embedding_mixed_in": ([38, 20, 10], 100), "d2t_missing": ([0, 0, 0], 150),
              "untrained": ([0, 0, 0], 150)}
    assert judge(counters([40, 20, 10], 100), right, plants, True).status == "pass"
    # other numerics (tokens differ): close to the draft and nearer it than any fault passes, with the tolerance
    close = judge(counters([45, 18, 12], 104), right, plants, False)
    assert close.status == "pass" and "within 0.1" in close.line and "numerics differ" in close.notes[0]
    assert any("cannot be told apart" in n and "aux_ids_minus_1" in n for n in close.notes)
    # same numerics: equal means equal; a small difference that a fault reproduces fails with that fault's cause
    v = judge(counters([39, 19, 11], 101), right, plants, True)
    assert v.status == "fail" and v.line.startswith("likely the aux layer ids") and "exactly" in v.line
    v = judge(counters([38, 20, 10], 100), right, plants, True)  # one count off at position 0: the embedding mixed in
    assert v.status == "fail" and "embedding output" in v.line
    # same numerics, a difference no fault reproduces: still a finding, the nearest fault named
    v = judge(counters([40, 19, 10], 100), right, plants, True)
    assert v.status == "fail" and "must be equal" in v.line and "nearest fault" in v.line
    # other numerics, nearer a fault than the draft: that fault, even within the tolerance
    v = judge(counters([12, 2, 0], 138), right, plants, False)
    assert v.status == "fail" and "aux layer ids" in v.line and "nearer" in v.line
    # nothing accepted: d2t or an untrained draft; the export tells them apart
    v = judge(counters([0, 0, 0], 150), right, plants, True)
    assert v.status == "fail" and "--export" in v.line
    v = judge(counters([0, 0, 0], 150), right, plants, True, ExportFacts("e", "missing", "same"))
    assert v.status == "fail" and "vocab map" in v.line and "d2t is missing" in v.line
    v = judge(counters([0, 0, 0], 150), right, plants, True, ExportFacts("e", "present", "differ"))
    assert v.status == "fail" and "untrained or foreign" in v.line
    v = judge(counters([70, 50, 30], 80), right, {}, False)
    assert v.status == "fail" and "another draft" in v.line
    v = judge(counters([0, 0, 0], 0), right, plants, True)
    assert v.status == "fail" and "drafted nothing" in v.line
    for verdict in (v, close):
        assert "\n" not in verdict.line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_closed_port_is_one_line(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # bound and released: nothing listens there
    with pytest.raises(ServingError, match="cannot reach"):
        ServerClient(url, timeout=5).counters()
    r = CliRunner().invoke(app, ["doctor", "serving", "--url", url, "--draft", "default", "--timeout", "5"])
    assert r.exit_code == 2, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach"), r.output


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://h/x", "http:// spaced", ""])
def test_bad_urls_are_refused(url):
    with pytest.raises(ServingError, match="--url"):
        ServerClient(url)


class _Page(BaseHTTPRequestHandler):
    """A real HTTP server that is not vLLM: what it answers per path is set on the server object."""

    def do_GET(self):  # noqa: N802 - the stdlib's name
        code, body = self.server.pages.get(self.path, (404, "not found"))
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *a):
        pass


@pytest.fixture
def page_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    srv.pages = {}
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("pages, says", [
    ({}, "answered 404: not an OpenAI-compatible vLLM"),
    ({"/metrics": (401, "no")}, "--api-key"),
    ({"/metrics": (500, "boom " * 1000)}, "answered HTTP 500: 'boom boom"),
    ({"/metrics": (200, "x" * (3 << 20))}, "sent more than 2 MiB"),
    ({"/metrics": (200, "<html>a web page</html>")}, "not Prometheus text"),
    ({"/metrics": (200, "vllm:num_requests_running 0\n")}, "without speculative decoding"),
])
def test_servers_that_are_not_a_speculating_vllm(page_server, pages, says, monkeypatch):
    import eyas.doctor.server as serving

    monkeypatch.setattr(serving, "MAX_BODY", 2 << 20)  # the cap, scaled down so the test page stays small
    page_server.pages = pages
    url = f"http://127.0.0.1:{page_server.server_address[1]}"
    r = CliRunner().invoke(app, ["doctor", "serving", "--url", url, "--draft", "default", "--timeout", "5"])
    assert r.exit_code == 2, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and says in lines[0], r.output


def test_k_mismatch_is_refused_before_the_target_loads(page_server):
    page_server.pages = {"/metrics": (200, VLLM_METRICS)}
    url = f"http://127.0.0.1:{page_server.server_address[1]}"
    r = CliRunner().invoke(app, ["doctor", "serving", "--url", url, "--draft", "default", "--k", "5"])
    assert r.exit_code == 2 and "--k 5, but the server drafts 3" in r.output, r.output


# ---- live vLLM servers ------------------------------------------------------------------------------

K = 3
PROMPTS, NEW_TOKENS = 3, 48  # small: CI has 2 cores and each server start costs about a minute
TIMINGS: dict[str, float] = {}
# each planted export, and what doctor serving must say of it (one vLLM server each, one at a time)
EXPECT = {
    "right": ("pass", "equal the replay of this draft exactly", None),
    "minus1": ("fail", "one below the trained ones", "aux_ids_minus_1"),
    "plus1": ("fail", "one above the trained ones", "aux_ids_plus_1"),
    "embedding": ("fail", "the embedding output (id 0)", "embedding_mixed_in"),
    "nod2t": ("fail", "vocab map", None),
    "random": ("fail", "untrained or foreign", None),
    "nomethod": ("fail", "the server failed a request", None),
}


def _vllm_python() -> Path | None:
    from eyas.vllm.env import VllmError, vllm_python

    try:
        return vllm_python(needed_for="the live doctor serving tests")
    except VllmError:
        return None


def _variant(right: Path, out: Path, ids=None, weights=None) -> Path:
    """A copy of the right export with its config's aux ids or its weights changed after export (so its
    manifest's digest no longer matches, which doctor flags notes)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(right, out)
    if ids is not None:
        cfg = json.loads((out / "config.json").read_text())
        cfg["eagle_aux_hidden_state_layer_ids"] = ids(cfg["eagle_aux_hidden_state_layer_ids"])
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if weights is not None:
        sd = load_file(out / "model.safetensors")
        weights(sd)
        save_file(sd, out / "model.safetensors")
    return out


def _randomize(sd) -> None:
    import torch

    g = torch.Generator().manual_seed(1)
    for k, v in list(sd.items()):
        if v.is_floating_point():
            sd[k] = torch.ones_like(v) if k.endswith("norm.weight") else torch.randn(v.shape, generator=g) * 0.02


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The bundled draft exported for vLLM by eyas, and the founding case's faults planted in copies of it."""
    from eyas.interop.export import export_draft
    from eyas.target.load import load_target

    root = tmp_path_factory.mktemp("serving")
    target = load_target("smollm2-135m")
    right = export_draft("default", "vllm", root / "right").path
    paths = {
        "right": right,
        "minus1": _variant(right, root / "minus1", ids=lambda v: [i - 1 for i in v]),  # SGLang's ids where vLLM's go
        "plus1": _variant(right, root / "plus1", ids=lambda v: [i + 1 for i in v]),
        "embedding": _variant(right, root / "embedding", ids=lambda v: [0, *v[1:]]),  # [0, 15, 27]
        "nod2t": _variant(right, root / "nod2t", weights=lambda sd: sd.pop("d2t")),
        "random": _variant(right, root / "random", weights=_randomize),  # random weights, d2t intact
        "nomethod": right,  # the right export, served without "method": "eagle3"
    }
    return target, paths


def _spec(name: str, draft: Path) -> dict:
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": K}
    if name == "nomethod":
        del spec["method"]
    return spec


def _start(py: Path, model: Path, spec: dict, log: Path, dtype: str = "float32") -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1"}
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", dtype, "--max-model-len", "1024", "--speculative-config",
           json.dumps(spec),
           # eager: vLLM's CPU torch.compile warm-up took ~10 minutes of a loaded 2-core AMD EPYC Zen 4, eager ~1
           "--enforce-eager"]
    with open(log, "w") as f:
        # its own session, so the whole process group (API server, engine core, worker) can be ended at teardown
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return p, f"http://127.0.0.1:{port}"


def _stop(p: subprocess.Popen) -> None:
    import signal

    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)


def wait_up(p: subprocess.Popen, url: str, log: Path, limit: float = 900) -> float:
    import httpx

    t0 = time.perf_counter()
    while True:
        if p.poll() is not None:
            pytest.fail(f"vllm serve exited ({p.returncode}); its log:\n" + log.read_text()[-3000:])
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        if time.perf_counter() - t0 > limit:
            pytest.fail("vllm serve did not come up in 15 minutes; its log:\n" + log.read_text()[-3000:])
        time.sleep(2)


@pytest.fixture(scope="module", params=list(EXPECT))
def vllm_server(request, exports, tmp_path_factory):
    """One real vLLM server per export; pytest runs a parametrized module fixture one parameter at a time, so
    only one server lives at once (2 cores)."""
    py = _vllm_python()
    if py is None:
        pytest.skip("no vLLM python found (make vllm builds .venv-vllm, or set $EYAS_VLLM_PYTHON)")
    target, paths = exports
    log = tmp_path_factory.mktemp("vllm-log") / f"{request.param}.log"
    spec = _spec(request.param, paths[request.param])
    p, url = _start(py, target.path, spec, log)
    try:
        TIMINGS[f"start {request.param}"] = wait_up(p, url, log)
        print(f"\nvllm serve ({request.param}) up in {TIMINGS[f'start {request.param}']:.0f} s")
        yield request.param, url, target, paths[request.param], spec
    finally:
        _stop(p)


@pytest.mark.vllm
@pytest.mark.integration
def test_live_server_verdict(vllm_server):
    """The founding case's faults against a live vLLM, each named from the replay of the planted fault: the
    right export passes with counts equal to the replay's, and each fault fails with its cause."""
    from eyas.bench.prompts import load_prompts
    from eyas.doctor.serving import check_server, render_serving
    from eyas.engine.prompt import chat_input_ids
    from eyas.replay.rows import cached_rows_eyas, plant_streams

    name, url, target, export, spec = vllm_server
    ids = [chat_input_ids(target.tokenizer, r.messages) for r in load_prompts("mt-bench", limit=PROMPTS)]
    rows = cached_rows_eyas(target, ids, NEW_TOKENS, plant_streams([2, 15, 27], target.num_layers))
    command = ["vllm", "serve", str(target.path), "--speculative-config", json.dumps(spec)]
    t0 = time.perf_counter()
    if name == "nomethod":  # the command line as a user types it: rows from the cache, the launch command after --
        r = CliRunner().invoke(app, ["doctor", "serving", "--url", url, "--draft", "default", "--prompts",
                                     str(PROMPTS), "--max-new-tokens", str(NEW_TOKENS), "--export", str(export),
                                     "--", *command])
        print("\n" + r.output)
        assert r.exit_code == 1 and 'FAIL: the server failed a request' in r.output and 'no "method"' in r.output, \
            r.output
        return  # its engine is dead now
    rep = check_server(url, target, "default", rows, export=export, command=command)
    TIMINGS[f"check {name}"] = time.perf_counter() - t0
    lines: list[str] = []
    render_serving(rep, lines.append)
    print("\n" + "\n".join(lines) + f"\n(check {TIMINGS[f'check {name}']:.0f} s)")
    status, says, reproduced = EXPECT[name]
    assert rep.verdict.status == status and says in rep.verdict.line, rep.verdict.line
    assert "\n" not in rep.verdict.line
    assert rep.k == K and rep.same_tokens == PROMPTS  # same target, same numerics: identical greedy text
    if reproduced is not None:
        assert rep.reproduced_by == reproduced
    if name == "nod2t":
        assert rep.export["d2t"] == "missing"
    if name == "random":
        assert rep.export["d2t"] == "present" and rep.export["weights"] == "differ"
