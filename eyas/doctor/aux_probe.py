"""Ask a live SGLang server which streams it feeds an EAGLE-3 draft (`eyas doctor streams`): send a few prompts to a
server started with `--enable-return-aux-hidden-states --speculative-algorithm EAGLE3
[--return-aux-hidden-state-layer-ids ...]`, read the aux states it returns, and name the stream index (eyas's
convention, eyas/layout.py) each slot is, by comparing it with the target's own streams computed here.

What SGLang 0.5.23 does (read in its source, python/sglang/srt/; no SGLang code is used here):
- arg_groups/fields/exec_.py:130-138 `enable_return_aux_hidden_states`: the target captures its aux hidden states
  without a draft, and requests with `return_hidden_states` receive their concatenation in place of the last-layer
  state; `--return-aux-hidden-state-layer-ids` (exec_.py:152) defaults to the model's EAGLE-3 layers.
  arg_groups/validation_hook.py:697 `handle_aux_hidden_state_capture`: pp_size 1 only, needs
  --speculative-algorithm EAGLE3|DFLASH|DSPARK to name the convention.
- The model class turns the ids into `layers_to_capture` (models/llama.py:929 `set_eagle3_layers_to_capture`: +1 to
  every id, :941; models/deepseek_v2.py:3470-3473: +1 only when ids[0] == 1; models/gpt_oss.py:1349-1350: as-is when
  max(ids) == num_layers; models/qwen3_moe.py:1143: +1), and the forward captures the residual stream entering layer
  i for each i in layers_to_capture (models/llama.py:485-492, the capture in the layer's attn_boundary.prepare,
  llama.py:403): stream i, in layer order, len(ids) x hidden_size wide. This module applies none of those rules: it
  measures, so it stays true for a release or model class whose rule differs.
- Response of /generate: managers/scheduler_components/batch_result_processor.py:641 `_append_prefill_hidden_states`
  appends one 2-D list per stored prefill chunk (:659; rows = that chunk's extend_input_len), but the caller stores a
  chunk only when `req.inflight_middle_chunks <= 0` (:308-312, :340), and the scheduler raises that count for every
  chunk that leaves the prompt unfinished (managers/scheduler.py:4329-4330, schedule_policy.py:1222
  `add_chunked_req`): with chunked prefill only the LAST chunk's rows come back. :676
  `_append_decode_hidden_states` then extends with one 1-D row per decoded token (:699);
  managers/scheduler_components/output_streamer.py:674 keeps `hs[:req.finished_len]` (entries, so the prefill entry
  survives); managers/tokenizer_manager.py:2598-2601 sets meta_info["hidden_states"], :2557 meta_info["cached_tokens"]
  (the prefix-cache hits, counted once per request: managers/schedule_batch.py:2968-2974).
- So the rows are always the tail of the prompt: the radix cache (on by default) gives no row to the cached prefix,
  chunked prefill none to the chunks before the last. The rows align to the prompt's end, and the count missing is
  reported (cached_tokens of it from the cache when the server says).

Live evidence (SGLang 0.5.23 on an AVX-512 CPU, bf16, its capture without a draft, against transformers'
hidden_states): SmolLM2-135M llama.py ids [1,14,26] -> streams [2,15,27], [2,15,27] -> [3,16,28]; tiny DeepSeek-V3
deepseek_v2.py [1,2] -> [2,3], [2,3] -> [2,3], [0,2] -> [0,2]; tiny Qwen3-MoE qwen3_moe.py [0,2] -> [1,3]; best
stream 0.2-1.3% off, neighbours >= 13.9%.
"""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import EyasError

# a slot names stream k when k's median per-row relative error is within MATCH_MAX and the runner-up's is at least
# CLEAR_RATIO times larger: bf16 serving measured 0.2-1.3% on the best stream and >= 13.9% on every neighbour
MATCH_MAX = 0.05
CLEAR_RATIO = 3.0
MAX_BODY = 512 << 20  # bytes read from one response at most (a 32-token prompt at 3 x 7168 is ~8 MB of JSON)
POST_NORM = -1  # the candidate "final state after the norm" (what a server without aux capture returns)

# short, distinct prompts: each run prefixes them with one random tag, so a rerun does not hit the radix cache
PROMPTS = [
    "Explain why the sky looks blue on a clear afternoon.",
    "Write a short poem about a hawk circling over a field.",
    "List three ways to keep bread fresh for longer.",
    "What is the difference between a list and a tuple in Python?",
    "Describe the water cycle to a ten-year-old.",
    "Give me a recipe for a simple tomato soup.",
    "How does a bicycle stay upright while it moves?",
    "Summarise the plot of a detective story in two sentences.",
]


class AuxProbeError(EyasError):
    """The served streams cannot be read (unreachable server, capture off, a width that fits no target layout)."""


def _label(k: int) -> str:
    return "final (post-norm)" if k == POST_NORM else str(k)


# ---- HTTP -----------------------------------------------------------------------------------------------------


def _call(url: str, path: str, body: dict | None, timeout: float, api_key: str | None) -> Any:
    """GET (body None) or POST JSON; the parsed JSON answer. Every failure is one AuxProbeError line."""
    full = url.rstrip("/") + path
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(full, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read(MAX_BODY + 1)
    except urllib.error.HTTPError as e:
        msg = e.read(2000).decode(errors="replace").strip().replace("\n", " ")
        raise AuxProbeError(f"{full}: HTTP {e.code} {e.reason}: {msg[:300] or '(no body)'}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        reason = getattr(reason, "strerror", None) or reason  # "Connection refused", not "[Errno 111] ..."
        raise AuxProbeError(f"cannot reach {full} ({reason}): is the SGLang server up at {url}?") from None
    if len(raw) > MAX_BODY:
        raise AuxProbeError(f"{full}: the answer exceeds {MAX_BODY >> 20} MB; use fewer --prompts")
    try:
        return json.loads(raw)
    except ValueError:
        raise AuxProbeError(f"{full}: the answer is not JSON ({raw[:80]!r}): is {url} an SGLang server?") from None


def server_facts(url: str, timeout: float, api_key: str | None) -> dict[str, Any]:
    """What /server_info and /model_info say (SGLang entrypoints/http_server.py:812, :863; server_info is
    server_args.resolved_dict() plus the version, utils/common.py:3584). Best effort: an unreachable server fails
    here, an endpoint that answers otherwise only leaves its facts out."""
    facts: dict[str, Any] = {}
    try:
        info = _call(url, "/server_info", None, timeout, api_key)
    except AuxProbeError as e:
        if str(e).startswith("cannot reach"):
            raise
        info = {}
    if isinstance(info, dict):
        for key in ("version", "return_aux_hidden_state_layer_ids", "enable_return_aux_hidden_states",
                    "disable_radix_cache", "chunked_prefill_size", "speculative_algorithm"):
            if key in info:
                facts[key] = info[key]
    try:
        model = _call(url, "/model_info", None, timeout, api_key)
    except AuxProbeError:
        model = {}
    if isinstance(model, dict):
        for key in ("model_path", "model_type", "architectures"):
            if model.get(key) is not None:
                facts[key] = model[key]
    return facts


def generate(url: str, ids: list[int], max_new_tokens: int, timeout: float, api_key: str | None) -> dict:
    """One /generate (managers/io_struct.py GenerateReqInput: input_ids, sampling_params, return_hidden_states)."""
    body = {"input_ids": ids, "return_hidden_states": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
    out = _call(url, "/generate", body, timeout, api_key)
    if isinstance(out, list) and len(out) == 1:
        out = out[0]
    if not isinstance(out, dict):
        raise AuxProbeError(f"{url}/generate answered {type(out).__name__}, not an SGLang generate result")
    return out


# ---- the rows of one answer -----------------------------------------------------------------------------------


@dataclass
class ServedRows:
    """The prefill rows one answer carries: the last rows.shape[0] tokens of the prompt."""

    rows: torch.Tensor  # [R, W] the prefill rows, entries in order (R <= prompt length)
    prompt_len: int
    chunks: int  # 2-D entries (one in 0.5.23: only the last prefill chunk is stored)
    decode_rows: int  # 1-D entries (decoded tokens), not compared
    cached_tokens: int | None  # meta_info["cached_tokens"] when the server sent it

    @property
    def offset(self) -> int:
        """Prompt position of row 0: the rows are the prompt's tail (module docstring)."""
        return self.prompt_len - self.rows.shape[0]

    @property
    def missing(self) -> int:
        return self.offset


def served_rows(answer: dict, prompt_len: int) -> ServedRows:
    """meta_info.hidden_states -> the prefill rows [R, W] (the prompt's last R tokens). Raises AuxProbeError when the
    server returned no states (capture or return_hidden_states off) or a malformed list."""
    meta = answer.get("meta_info")
    if not isinstance(meta, dict):
        raise AuxProbeError("the /generate answer has no meta_info: is this an SGLang server?")
    hs = meta.get("hidden_states")
    if not hs:
        raise AuxProbeError("the server returned no hidden_states: start it with --enable-return-aux-hidden-states "
                            "--speculative-algorithm EAGLE3 --return-aux-hidden-state-layer-ids <the draft's ids> "
                            "(SGLang >= 0.5.23)")
    if not isinstance(hs, list):
        raise AuxProbeError(f"meta_info.hidden_states is a {type(hs).__name__}: expected a list (one 2-D list per "
                            "prefill chunk, one row per decoded token)")
    chunks: list[list[list[float]]] = []
    decode = 0
    for entry in hs:
        if isinstance(entry, list) and entry and isinstance(entry[0], list):
            if decode:
                raise AuxProbeError("meta_info.hidden_states has a prefill chunk after decode rows: not SGLang "
                                    "0.5.23's format (batch_result_processor.py _append_prefill_hidden_states)")
            chunks.append(entry)
        elif isinstance(entry, list) and entry and isinstance(entry[0], (int, float)):
            decode += 1
        elif isinstance(entry, list) and not entry:
            continue  # a chunk of zero rows
        else:
            raise AuxProbeError(f"meta_info.hidden_states holds a {type(entry).__name__} entry: expected lists "
                                "(one 2-D list per prefill chunk, one row per decoded token)")
    flat = [row for c in chunks for row in c]
    widths = {len(r) if isinstance(r, list) else -1 for r in flat}
    if len(widths) > 1 or -1 in widths:
        raise AuxProbeError(f"the prefill rows are not one width ({sorted(widths)}): a malformed answer")
    try:
        rows = torch.tensor(flat, dtype=torch.float32) if flat else torch.zeros(0, 0)  # [R, W]
    except (TypeError, ValueError):
        raise AuxProbeError("meta_info.hidden_states rows are not numbers") from None
    if rows.shape[0] > prompt_len:
        raise AuxProbeError(f"{rows.shape[0]} prefill rows for a {prompt_len}-token prompt: the server did not take "
                            "the prompt as sent")
    cached = meta.get("cached_tokens")
    return ServedRows(rows, prompt_len, len(chunks), decode, cached if isinstance(cached, int) else None)


def _why_missing(got: ServedRows) -> str:
    c = got.cached_tokens
    if c is None:
        return "radix-cached prefix, or prefill chunks before the last"
    if c >= got.missing:
        return "radix-cached prefix"
    return (f"{c} radix-cached, {got.missing - c} in prefill chunks before the last" if c else
            "prefill chunks before the last")


# ---- the target's own streams ----------------------------------------------------------------------------------


@torch.no_grad()
def target_streams(target, ids: list[int]) -> torch.Tensor:
    """ids [S] -> [S, L+2, H]: streams 0..L (eyas's hooks, eyas.target.capture) then the post-norm final state."""
    from ..target.capture import capture

    L, H = target.num_layers, target.hidden_size
    x = torch.tensor([ids], device=target.device)
    cap = capture(target.model, x, list(range(L)))
    aux = cap.aux[0].float().view(len(ids), L, H)  # [S, L, H]
    return torch.cat([aux, cap.final_prenorm[0].float()[:, None], cap.final_postnorm[0].float()[:, None]], dim=1)


# ---- matching --------------------------------------------------------------------------------------------------


@dataclass
class SlotMatch:
    slot: int
    stream: int | None  # the stream named (POST_NORM for the post-norm final), None when none is clear
    best: int
    best_err: float  # median per-row relative error
    runner_up: int
    runner_err: float
    why: str = ""  # why none is named

    def line(self) -> str:
        got = (f"stream {_label(self.stream)}" if self.stream is not None else "no stream named")
        return (f"slot {self.slot}: {got}  (best {_label(self.best)} {100 * self.best_err:.2f}% off, runner-up "
                f"{_label(self.runner_up)} {100 * self.runner_err:.2f}%)" + (f": {self.why}" if self.why else ""))


def match_slots(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], n_aux: int, L: int) -> list[SlotMatch]:
    """pairs: (served rows [R, n_aux*H], the target's streams at the same positions [R, L+2, H]). For each slot, the
    median over all rows of ||served - stream_k|| / ||stream_k|| for every candidate k; a median, so that position
    0's massive activation (SmolLM2: ~25000 against ~150 elsewhere, and alike in neighbouring streams) weighs as
    one row."""
    cands = list(range(L + 1)) + [POST_NORM]
    out = []
    for j in range(n_aux):
        errs = []
        for served, local in pairs:
            H = local.shape[-1]
            s = served[:, j * H:(j + 1) * H].float()  # [R, H]
            diff = (s[:, None, :] - local).norm(dim=-1)  # [R, L+2]
            errs.append(diff / local.norm(dim=-1).clamp_min(1e-12))
        med = torch.cat(errs).median(dim=0).values  # [L+2]
        order = med.argsort().tolist()
        b, r = order[0], order[1]
        best, runner = cands[b], cands[r]
        be, re_ = float(med[b]), float(med[r])
        stream: int | None = best
        why = ""
        if be > MATCH_MAX:
            stream, why = None, (f"matches no stream of this target within {100 * MATCH_MAX:.0f}%: the server "
                                 "serves other weights (another model, quantization or revision than --target)")
        elif re_ < CLEAR_RATIO * be:
            stream, why = None, (f"stream {_label(best)} is not clearly better than {_label(runner)} (needs "
                                 f"{CLEAR_RATIO:.0f}x): too few rows to tell; send more --prompts")
        out.append(SlotMatch(j, stream, best, be, runner, re_, why))
    return out


# ---- the check -------------------------------------------------------------------------------------------------


@dataclass
class StreamsReport:
    url: str
    facts: dict[str, Any]
    hidden: int
    width: int
    slots: list[SlotMatch]
    prompts: list[dict[str, Any]]  # per prompt: tokens, rows, missing, cached_tokens, chunks, decode_rows
    trained: list[int] | None = None
    verdict: str = "info"  # pass | fail | info (no --draft, every slot named) | unclear
    lines: list[str] = field(default_factory=list)  # the verdict's explanation

    @property
    def served(self) -> list[int | None]:
        return [s.stream for s in self.slots]

    @property
    def ok(self) -> bool:
        return self.verdict in ("pass", "info")

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "server": self.facts, "hidden_size": self.hidden, "width": self.width,
                "served_streams": self.served, "trained_streams": self.trained, "verdict": self.verdict,
                "lines": self.lines, "prompts": self.prompts,
                "slots": [{"slot": s.slot, "stream": s.stream, "best": s.best, "best_error": round(s.best_err, 6),
                           "runner_up": s.runner_up, "runner_up_error": round(s.runner_err, 6), "why": s.why}
                          for s in self.slots]}


def _verdict(rep: StreamsReport) -> None:
    served = rep.served
    ids = rep.facts.get("return_aux_hidden_state_layer_ids")
    named = [s for s in served if s is not None]
    if served == [POST_NORM]:
        rep.verdict = "fail"
        rep.lines.append("the server returns the final state after the norm, not aux states: "
                         "--enable-return-aux-hidden-states is off (or --speculative-algorithm is not EAGLE3)")
        return
    if len(named) < len(served):
        rep.verdict = "unclear" if rep.trained is None else "fail"
        rep.lines.append("not every slot could be named (see above), so what the draft is fed is unknown")
        return
    tapped = f"the server taps streams {served}" + (f" for ids {ids}" if ids is not None else "")
    if rep.trained is None:
        rep.lines.append(tapped + " (eyas stream indices: 0 = embedding output, k = input of layer k)")
        return
    t = list(rep.trained)
    if served == t:
        rep.verdict = "pass"
        rep.lines.append(tapped + ", the streams the draft was trained on")
        return
    rep.verdict = "fail"
    rep.lines.append(tapped + f", but the draft was trained on streams {t}")
    if len(served) != len(t):
        rep.lines.append(f"cause: the server feeds {len(served)} streams and the draft's fc reads {len(t)}: the "
                         "id list given to --return-aux-hidden-state-layer-ids is not the draft's")
    # named: served, now known to hold no None (every slot was named above)
    elif all(s - k == 1 for s, k in zip(named, t, strict=True)) or all(k - s == 1 for s, k in zip(named, t,
                                                                                                  strict=True)):
        side = "above" if named[0] > t[0] else "below"
        rep.lines.append(f"likely cause: off by one (every stream one {side}): the ids were written in the other "
                         "convention than this model class reads (SGLang's llama-family classes add +1, deepseek_v2 "
                         "only when the first id is 1, gpt_oss not when max(id) == layers); take the ids from "
                         "`eyas export --format sglang` or `eyas doctor flags --engine sglang --engine-version V`, "
                         "restart and re-run this check")
    else:
        rep.lines.append("cause: the server's ids are another layout than the draft's (not a uniform shift); "
                         "start it with the ids the draft's export carries")


def probe_streams(url: str, target, trained: list[int] | None = None, num_prompts: int = 4,
                  max_new_tokens: int = 8, timeout: float = 120.0, api_key: str | None = None,
                  tag: str | None = None, log: Callable[[str], None] | None = None) -> StreamsReport:
    """Send num_prompts prompts, read the served aux rows, name each slot's stream; with `trained` (the draft's
    layout.aux_indices) a PASS/FAIL verdict. tag: the prefix that keeps this run's prompts out of an earlier run's
    radix cache (random by default)."""
    if not 1 <= num_prompts <= len(PROMPTS):
        raise AuxProbeError(f"--prompts {num_prompts}: choose 1..{len(PROMPTS)}")
    if max_new_tokens < 1:
        raise AuxProbeError("--max-new-tokens must be at least 1")
    facts = server_facts(url, timeout, api_key)
    H, L = target.hidden_size, target.num_layers
    tag = tag if tag is not None else f"{random.SystemRandom().randrange(10**5, 10**6)}"
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    info: list[dict[str, Any]] = []
    width = None
    for text in PROMPTS[:num_prompts]:
        ids = list(target.tokenizer(f"[{tag}] {text}")["input_ids"])
        got = served_rows(generate(url, ids, max_new_tokens, timeout, api_key), len(ids))
        R = got.rows.shape[0]
        info.append({"tokens": len(ids), "rows": R, "missing": got.missing, "cached_tokens": got.cached_tokens,
                     "chunks": got.chunks, "decode_rows": got.decode_rows})
        if log:
            log(f"prompt {len(info)}: {len(ids)} tokens, {R} prefill rows" + (
                f", the first {got.missing} without a row ({_why_missing(got)}); the rows align to the prompt's end"
                if got.missing else ""))
        if R == 0:
            continue
        W = got.rows.shape[1]
        if width is not None and W != width:
            raise AuxProbeError(f"the server returned rows {width} wide, then {W}: a malformed answer")
        width = W
        if W % H:
            raise AuxProbeError(f"the server's rows are {W} wide, not a multiple of --target's hidden size {H}: "
                                "--target is not the model the server serves")
        local = target_streams(target, ids)[got.offset:got.offset + R]  # [R, L+2, H]
        pairs.append((got.rows, local))
    if not pairs:
        raise AuxProbeError("every prompt token was served from the radix cache, so no rows came back: send "
                            "distinct prompts, or start the server with --disable-radix-cache")
    assert width is not None
    rep = StreamsReport(url, facts, H, width, match_slots(pairs, width // H, L), info,
                        trained=list(trained) if trained is not None else None)
    _verdict(rep)
    return rep


def render_streams(rep: StreamsReport, echo: Callable[[str], None]) -> None:
    f = rep.facts
    head = f"server {rep.url}" + (f" (SGLang {f['version']})" if "version" in f else "")
    if f.get("architectures"):
        head += f", {', '.join(map(str, f['architectures']))}"
    if f.get("return_aux_hidden_state_layer_ids") is not None:
        head += f", launched with --return-aux-hidden-state-layer-ids {f['return_aux_hidden_state_layer_ids']}"
    echo(head)
    rows = sum(p["rows"] for p in rep.prompts)
    missing = sum(p["missing"] for p in rep.prompts)
    echo(f"{len(rep.prompts)} prompts, {rows} prefill rows compared"
         + (f", {missing} prompt tokens without a row (radix-cached prefix)" if missing else "")
         + f"; rows {rep.width} wide = {rep.width // rep.hidden} x hidden {rep.hidden}")
    for s in rep.slots:
        echo("  " + s.line())
    tag = {"pass": "PASS", "fail": "FAIL", "info": "served", "unclear": "UNCLEAR"}[rep.verdict]
    for i, line in enumerate(rep.lines):
        echo(f"{tag}: {line}" if i == 0 else f"  {line}")
