"""`eyas doctor streams` (eyas/doctor/aux_probe.py) against a stand-in SGLang 0.5.23 server: which streams a live
server feeds an EAGLE-3 draft, named by matching its returned aux states against the target's own streams.

No SGLang runs here (it needs a kernel built from source on CPU and Intel AMX for its EAGLE-3 path), so the stand-in
answers /generate in 0.5.23's exact format, read in its source (python/sglang/srt/ of the sglang==0.5.23 wheel):
- the ids become `layers_to_capture` by the model class's `set_eagle3_layers_to_capture`: models/llama.py:941 and
  models/qwen3_moe.py:1143 add +1 to every id; models/deepseek_v2.py:3470-3473 adds +1 only when ids[0] == 1;
- the forward captures the residual stream entering layer i for each i in layers_to_capture, in layer order, only for
  i in range(num_layers) (models/llama.py:485-492): the stand-in takes transformers' hidden_states[i] (i < L: the
  input of layer i, before any norm), computed in bf16 as the live server runs, not eyas's hooks;
- batch_result_processor.py:641-659 appends one 2-D list per stored prefill chunk, rows = the uncached tokens
  (extend_input_len); :308-312, :340 store a chunk only when inflight_middle_chunks <= 0, which the scheduler raises
  for every chunk that leaves the prompt unfinished (scheduler.py:4329-4330, schedule_policy.py:1222): only the last
  chunk comes back; :676-699 one 1-D row per decoded token; output_streamer.py:674 keeps hs[:finished_len] with
  finished_len = max_new_tokens (schedule_batch.py:2042); tokenizer_manager.py:2557 meta_info["cached_tokens"],
  :2598-2601 meta_info["hidden_states"];
- the radix cache: a prompt sharing a prefix with an earlier one gets rows for its suffix only (never for none of it:
  the last token is always computed);
- /server_info carries the resolved server args and the version (http_server.py:863, utils/common.py:3584),
  /model_info the architectures (http_server.py:812).
The table matched is the live evidence in eyas/doctor/aux_probe.py (SGLang 0.5.23, CPU, bf16): llama ids +1,
deepseek_v2 +1 only when the first id is 1 (so [0, 2] taps the embedding), qwen3_moe +1.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from eyas.cli import app
from eyas.doctor.aux_probe import AuxProbeError, match_slots, probe_streams, served_rows
from tests.moe import save_moe_target
from tests.tiny import tiny_model


def llama_rule(ids: list[int], L: int) -> list[int]:
    return [i + 1 for i in ids]  # models/llama.py:941, models/qwen3_moe.py:1143


def deepseek_rule(ids: list[int], L: int) -> list[int]:
    return [i + 1 for i in ids] if ids and ids[0] == 1 else list(ids)  # models/deepseek_v2.py:3470-3473


class StandIn:
    """What SGLang 0.5.23 answers for a target started with --enable-return-aux-hidden-states
    --speculative-algorithm EAGLE3 --return-aux-hidden-state-layer-ids IDS. mode: "aux" (the capture on), "off"
    (no hidden_states in meta_info), "refuse" (HTTP 400), "last" (the final post-norm state, as without aux capture),
    "badwidth" (rows one column short); chunk: chunked prefill size (None: one chunk); every_chunk: return every
    chunk (a format other releases may have) instead of 0.5.23's last one; cache_all: the radix cache serves a
    repeated prompt whole (no row); send_cached: meta_info carries cached_tokens."""

    def __init__(self, folder: Path, rule: Callable[[list[int], int], list[int]], ids: list[int], mode: str = "aux",
                 chunk: int | None = None, every_chunk: bool = False, cache_all: bool = False,
                 send_cached: bool = True, arch: str = "LlamaForCausalLM"):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
        self.L = self.model.config.num_hidden_layers
        self.ids, self.mode, self.chunk, self.every_chunk = ids, mode, chunk, every_chunk
        self.cache_all, self.send_cached, self.arch = cache_all, send_cached, arch
        # layer order, only layers that exist (llama.py:489-492 loops over range(start_layer, end_layer))
        self.capture = sorted({i for i in rule(ids, self.L) if 0 <= i < self.L})
        self.seen: list[list[int]] = []

    def cached_len(self, ids: list[int]) -> int:
        best = 0
        for s in self.seen:
            n = 0
            while n < min(len(s), len(ids)) and s[n] == ids[n]:
                n += 1
            best = max(best, n)
        self.seen.append(ids)
        return best if self.cache_all and best == len(ids) else min(best, len(ids) - 1)

    @torch.no_grad()
    def generate(self, body: dict) -> tuple[int, dict]:
        if self.mode == "refuse":
            return 400, {"error": {"message": "return_hidden_states requires --return-hidden-states-mode full"}}
        ids = body["input_ids"]
        M = body["sampling_params"]["max_new_tokens"]
        out = self.model(torch.tensor([ids]), output_hidden_states=True)
        hs = out.hidden_states  # L+1 entries [1, S, H]; hs[i] for i < L is the input of layer i
        if self.mode == "last":
            states = hs[-1][0]  # HF's last entry: after the final norm
        else:
            states = torch.cat([hs[i][0] for i in self.capture], dim=-1)  # [S, n*H]
            if self.mode == "badwidth":
                states = states[:, :-1]
        cached = self.cached_len(ids)
        rows = states[cached:].float()  # the uncached tokens (extend_input_len)
        if self.chunk:
            parts = list(rows.split(self.chunk))
            entries = [p.tolist() for p in (parts if self.every_chunk else parts[-1:])]
        else:
            entries = [rows.tolist()]
        if not rows.shape[0]:
            entries = [[]]
        entries += [states[-1].float().tolist() for _ in range(M - 1)]  # one 1-D row per decoded token
        entries = entries[:M]  # output_streamer.py:674, finished_len = max_new_tokens
        meta = {"id": "x", "finish_reason": {"type": "length", "length": M}, "prompt_tokens": len(ids),
                "completion_tokens": M}
        if self.send_cached:
            meta["cached_tokens"] = cached
        if self.mode != "off":
            meta["hidden_states"] = entries
        return 200, {"text": "", "output_ids": [0] * M, "meta_info": meta}

    def get(self, path: str) -> tuple[int, dict]:
        if path == "/server_info":
            return 200, {"version": "0.5.23", "enable_return_aux_hidden_states": self.mode != "off",
                         "return_aux_hidden_state_layer_ids": self.ids, "disable_radix_cache": False}
        if path == "/model_info":
            return 200, {"model_path": "stand-in", "architectures": [self.arch]}
        return 404, {"detail": "Not Found"}


@contextmanager
def serve(stand: StandIn):
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(*stand.get(self.path))

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self._send(*(stand.generate(body) if self.path == "/generate" else (404, {"detail": "Not Found"})))

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm2_tokenizer, smollm2_tokenizer_dir):
    """Tiny random targets with SmolLM2's tokenizer: llama (6 layers), DeepSeek-V3 and Qwen3-MoE (4 layers)."""
    root = tmp_path_factory.mktemp("aux-probe")
    m = tiny_model("llama", vocab=len(smollm2_tokenizer), hidden=32, layers=6)
    m.save_pretrained(root / "llama", safe_serialization=True)
    for f in smollm2_tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, root / "llama" / f.name)
    out = {"llama": root / "llama"}
    for fam in ("deepseek_v3", "qwen3_moe"):
        out[fam] = save_moe_target(fam, root / fam, smollm2_tokenizer_dir)
    return out


@pytest.fixture(scope="module")
def targets(folders):
    from eyas.target.load import load_target

    return {k: load_target(str(v)) for k, v in folders.items()}


RULES = {"llama": (llama_rule, "LlamaForCausalLM"), "deepseek_v3": (deepseek_rule, "DeepseekV3ForCausalLM"),
         "qwen3_moe": (llama_rule, "Qwen3MoeForCausalLM")}


def stand_in(folders, fam: str, ids: list[int], **kw) -> StandIn:
    rule, arch = RULES[fam]
    return StandIn(folders[fam], rule, ids, arch=arch, **kw)


@pytest.mark.parametrize("fam,ids,streams", [
    ("llama", [1, 2, 3], [2, 3, 4]),  # SmolLM2 llama.py [1,14,26] -> [2,15,27] live: +1
    ("llama", [2, 3, 4], [3, 4, 5]),  # [2,15,27] -> [3,16,28]
    ("deepseek_v3", [1, 2], [2, 3]),  # deepseek_v2.py: ids[0] == 1 -> +1
    ("deepseek_v3", [2, 3], [2, 3]),  # ids[0] != 1 -> as they are
    ("deepseek_v3", [0, 2], [0, 2]),  # id 0: the embedding output
    ("qwen3_moe", [0, 2], [1, 3]),  # qwen3_moe.py: +1
])
def test_names_the_streams_of_the_live_table(folders, targets, fam, ids, streams):
    with serve(stand_in(folders, fam, ids)) as url:
        rep = probe_streams(url, targets[fam], num_prompts=3)
    assert rep.served == streams, [s.line() for s in rep.slots]
    assert rep.verdict == "info" and rep.ok
    for s in rep.slots:  # bf16 serving against fp32 here: well within the margin, and clear of the runner-up
        assert s.best_err < 0.02 and s.runner_err > 5 * s.best_err, s.line()
    assert rep.facts["return_aux_hidden_state_layer_ids"] == ids and rep.facts["version"] == "0.5.23"
    assert f"the server taps streams {streams} for ids {ids}" in rep.lines[0]


@pytest.mark.parametrize("kw", [{}, {"send_cached": False}, {"chunk": 4}, {"chunk": 4, "every_chunk": True}])
def test_radix_cache_and_chunked_prefill_gaps(folders, targets, kw):
    """The prompts share this run's tag, so every prompt after the first gets rows for its suffix only; with
    chunked prefill 0.5.23 returns the last chunk alone. The rows align to the prompt's end either way."""
    with serve(stand_in(folders, "llama", [0, 2, 4], **kw)) as url:
        rep = probe_streams(url, targets["llama"], num_prompts=4, tag="424242")
    assert rep.served == [1, 3, 5], [s.line() for s in rep.slots]
    missing = [p["missing"] for p in rep.prompts]
    assert all(m > 0 for m in missing[1:]), missing  # the shared "[424242] " prefix came from the cache
    if not kw:
        assert missing[0] == 0
        assert [p["cached_tokens"] for p in rep.prompts] == missing
    if kw.get("chunk") and not kw.get("every_chunk"):
        assert all(p["rows"] <= 4 for p in rep.prompts)


def test_a_fully_cached_prompt_says_what_to_do(folders, targets):
    stand = stand_in(folders, "llama", [0, 2, 4], cache_all=True)
    with serve(stand) as url:
        probe_streams(url, targets["llama"], num_prompts=1, tag="1")  # fills the cache
        with pytest.raises(AuxProbeError, match="radix cache.*--disable-radix-cache"):
            probe_streams(url, targets["llama"], num_prompts=1, tag="1")


def test_the_format_as_parsed():
    chunk1 = [[1.0, 2.0], [3.0, 4.0]]
    chunk2 = [[5.0, 6.0]]
    ans = {"meta_info": {"hidden_states": [chunk1, chunk2, [7.0, 8.0], [9.0, 9.5]], "cached_tokens": 2}}
    got = served_rows(ans, 5)
    assert got.rows.tolist() == chunk1 + chunk2 and got.chunks == 2 and got.decode_rows == 2
    assert got.offset == 2 and got.missing == 2 and got.cached_tokens == 2
    with pytest.raises(AuxProbeError, match="no hidden_states.*--enable-return-aux-hidden-states"):
        served_rows({"meta_info": {"prompt_tokens": 5}}, 5)
    with pytest.raises(AuxProbeError, match="rows for a 1-token prompt"):
        served_rows(ans, 1)
    with pytest.raises(AuxProbeError, match="prefill chunk after decode rows"):
        served_rows({"meta_info": {"hidden_states": [[1.0, 2.0], chunk1]}}, 5)
    with pytest.raises(AuxProbeError, match="not one width"):
        served_rows({"meta_info": {"hidden_states": [[[1.0, 2.0], [1.0]]]}}, 5)


def test_refuses_to_name_a_stream_it_cannot_tell():
    """Two candidate streams almost alike: the best is not clearly better than the runner-up, so no stream is named."""
    g = torch.Generator().manual_seed(0)
    local = torch.randn(8, 4, 16, generator=g)  # [R, L+2 = 4 candidates (L = 2), H]
    local[:, 1] = local[:, 0] * 1.01
    served = local[:, 0] * 1.004  # [R, H]: 0.4% from stream 0, 0.6% from stream 1
    (s,) = match_slots([(served, local)], 1, 2)
    assert s.stream is None and "not clearly better" in s.why
    (s,) = match_slots([(torch.randn(8, 16, generator=g), local)], 1, 2)
    assert s.stream is None and "matches no stream" in s.why


def _draft(target, folder: Path, streams: list[int]) -> Path:
    from eyas.draft import DraftConfig, Eagle3Draft, save_draft

    cfg = DraftConfig.from_target_config(target.config, 256, num_aux=len(streams))
    torch.manual_seed(0)
    model = Eagle3Draft(cfg)
    model.set_vocab_map(torch.arange(256))
    return save_draft(folder, model, target.default_layout(streams))


def _cli(*args: str):
    return CliRunner().invoke(app, ["doctor", "streams", *args])


def test_pass_and_fail_against_the_draft(folders, targets, tmp_path):
    """PASS when the served streams are the trained ones; FAIL naming both and the off-by-one: stream indices passed
    as ids to a llama target (+1: one above), and the founding case on a DeepSeek-V3-shaped target, a draft trained
    on [1, 3] exported in the llama rule's ids [0, 2], which deepseek_v2 takes as they are (first id not 1): one
    below."""
    ds = _draft(targets["deepseek_v3"], tmp_path / "ds", [2, 3])
    with serve(stand_in(folders, "deepseek_v3", [1, 2])) as url:
        r = _cli("--url", url, "--target", str(folders["deepseek_v3"]), "--draft", str(ds), "--prompts", "2")
    assert r.exit_code == 0, r.output
    assert "PASS: the server taps streams [2, 3] for ids [1, 2], the streams the draft was trained on" in r.output

    ll = _draft(targets["llama"], tmp_path / "ll", [1, 3])
    with serve(stand_in(folders, "llama", [1, 3])) as url:  # stream indices passed as ids: +1 on llama
        r = _cli("--url", url, "--target", str(folders["llama"]), "--draft", str(ll), "--prompts", "2")
    assert r.exit_code == 1, r.output
    assert "FAIL: the server taps streams [2, 4] for ids [1, 3], but the draft was trained on streams [1, 3]" \
        in r.output
    assert "off by one (every stream one above)" in r.output

    d3 = _draft(targets["deepseek_v3"], tmp_path / "d3", [1, 3])
    with serve(stand_in(folders, "deepseek_v3", [0, 2])) as url:  # llama-rule ids for [1, 3]: as-is on deepseek
        r = _cli("--url", url, "--target", str(folders["deepseek_v3"]), "--draft", str(d3), "--prompts", "2",
                 "--json")
    assert r.exit_code == 1, r.output
    rep = json.loads(r.stdout)
    assert rep["verdict"] == "fail" and rep["served_streams"] == [0, 2] and rep["trained_streams"] == [1, 3]
    assert any("one below" in line for line in rep["lines"])


@pytest.mark.parametrize("mode,needle", [
    ("off", "the server returned no hidden_states: start it with --enable-return-aux-hidden-states"),
    ("refuse", "HTTP 400"),
    ("badwidth", "not a multiple of --target's hidden size 32"),
])
def test_bad_servers_give_one_line(folders, mode, needle):
    with serve(stand_in(folders, "llama", [0, 2, 4], mode=mode)) as url:
        r = _cli("--url", url, "--target", str(folders["llama"]), "--prompts", "1")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]  # besides progress lines
    assert len(errors) == 1 and needle in errors[0], r.output


def test_a_server_without_aux_capture_is_named(folders):
    """Rows as wide as one hidden state that are the post-norm final: the aux capture is off."""
    with serve(stand_in(folders, "llama", [0, 2, 4], mode="last")) as url:
        r = _cli("--url", url, "--target", str(folders["llama"]), "--prompts", "2")
    assert r.exit_code == 1, r.output
    assert "stream final (post-norm)" in r.output and "--enable-return-aux-hidden-states is off" in r.output


def test_unreachable_url_gives_one_line(folders):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _cli("--url", f"http://127.0.0.1:{port}", "--target", str(folders["llama"]))
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert r.output.strip().splitlines() == [f"error: cannot reach http://127.0.0.1:{port}/server_info (Connection "
                                             f"refused): is the SGLang server up at http://127.0.0.1:{port}?"]
