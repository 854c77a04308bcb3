"""`eyas doctor serving` against SGLang: its per-request speculative counts against the replay of the same draft.

SGLang's /metrics holds only gauges averaged over a log interval, but each response can carry the request's own
counts. How SGLang 0.5.23 counts them (read in its source, python/sglang/srt/):
- a request asks with `"return_spec_tokens_details": true` (entrypoints/openai/protocol.py CompletionRequest,
  line 393; ChatCompletionRequest line 961); /v1/completions takes a token-id prompt (`prompt: List[int]`, line
  372, passed as input_ids: serving_completions.py ~line 98) and answers the new ids as `choices[0].token_ids`
  with `return_token_ids` (CompletionResponseChoice, line 513; serving_completions.py line 622);
- the counts come back as `sglext.spec_tokens_details` (SglExt, protocol.py ~line 470; built from the first
  result's meta_info, one object when n = 1: serving_completions.py 548-572, utils.py
  `spec_tokens_details_from_meta_info` ~line 310) with `spec_verify_ct`, `spec_num_correct_drafts`,
  `spec_num_proposed_drafts` and `spec_correct_drafts_histogram` (SpecTokensDetails, protocol.py line 456);
- one verify round = one decode step of a request that has not finished: in
  managers/scheduler_components/batch_result_processor.py `_resolve_spec_v2_tokens` (lines 815-840, the only
  place these counters move) `spec_verify_ct += 1`, `spec_num_correct_drafts += accept_len - 1` (the bonus token
  excluded) and `update_spec_correct_drafts_histogram(that number)` (managers/schedule_batch.py line 1566: bin j
  = rounds that accepted j drafts, the list grown only as far as the largest j seen);
- the prefill's first token is no verify round (it comes from process_batch_result_prefill, which touches none
  of them), so spec_verify_ct = the decode rounds after it;
- the last round counts every draft it accepted, also those past max_tokens or an end token: the counts are
  taken before `req.update_finish_state` (schedule_batch.py line 2007) cuts the output at finished_len; a round
  of a request that finished earlier (an overlap scheduler's extra tick) is skipped (`req.finished()`, line 819);
- managers/tokenizer_manager.py `_calculate_spec_decoding_metrics` (~3140-3200) fills the fields only when
  spec_verify_ct > 0, sets spec_num_proposed_drafts = spec_verify_ct * (num_draft_tokens - 1) with the
  num_draft_tokens the server runs, and the histogram only when it is non-empty.
eyas's replay counts the same way (eyas.replay.run: rounds after the prefill, a reply's last round whole), so a
right server's counts equal the replay's: h[j] for j = 0..steps, per position c[i] = sum_{j>i} h[j], rounds =
spec_verify_ct, and eyas.doctor.serving.judge and the planted faults serve both engines.

The draft shape is what the server runs: /server_info's resolved speculative_num_steps / eagle_topk /
num_draft_tokens (arg_groups/speculative_hook.py ~line 1255 rewrites num_draft_tokens to steps + 1 with topk 1
before they are published), else the launch command after -- or --sglang, with that rewrite applied.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..replay.plants import FAULTS
from ..replay.rows import ReplayRows
from .server import EngineAnswer, ServerClient, ServingError, SpecCounters
from .serving import Counts, ServingReport, Verdict, export_facts, flags_checks, judge

VERIFIED = "0.5.23"  # the SGLang release whose code these fields and rules were read from


@dataclass(frozen=True)
class Shape:
    steps: int
    topk: int
    num_draft_tokens: int  # what the server runs (after the topk-1 rewrite)
    source: str  # where it was read

    def flags(self) -> str:
        return f"{self.steps},{self.topk},{self.num_draft_tokens}"


def _runs(steps: int, topk: int, ntok: int | None) -> tuple[int, int, int]:
    """What SGLang runs for these flags: with topk 1 it verifies steps + 1 tokens whatever num_draft_tokens says
    (arg_groups/speculative_hook.py ~line 1255, a log warning only)."""
    return steps, topk, steps + 1 if topk == 1 or ntok is None else ntok


def _asked(command: list[str] | None, given: str | None) -> tuple[tuple[int, int, int], str] | None:
    from ..text import parse_int_list

    if given is not None:
        v = parse_int_list(given, "--sglang") or []
        if len(v) != 3 or min(v) < 1:
            raise ServingError(f"--sglang {given!r}: expected STEPS,TOPK,NUM_DRAFT_TOKENS, e.g. 3,1,4")
        return _runs(*v), f"--sglang {given}"
    if not command:
        return None
    from .launch_command import FlagsError, parse_serve_command

    try:
        cmd = parse_serve_command(command)
    except FlagsError as e:
        raise ServingError(f"the launch command after --: {e}") from e
    if cmd.engine != "sglang":
        raise ServingError("the launch command after -- starts vLLM, but the server at --url is SGLang: pass the "
                           "command SGLang was started with")
    try:
        steps, topk, ntok = (int(cmd.opts[k]) if cmd.opts.get(k) else None for k in ("steps", "topk", "draft_tokens"))
    except ValueError as e:
        raise ServingError(f"the launch command after --: a speculative option is not an integer ({e})") from e
    if steps is None or topk is None or (ntok is None and topk != 1):
        return None  # SGLang fills what is missing by architecture: only the server can tell
    return _runs(steps, topk, ntok), "the launch command"


def resolve_shape(info: dict[str, Any] | None, command: list[str] | None, given: str | None) -> Shape:
    """The server's steps / topk / num_draft_tokens: /server_info's resolved values when it gives them; the launch
    command or --sglang (with SGLang's topk-1 rewrite applied) must agree with them, or stand in for them."""
    runs = None
    if info is not None:
        vals: list[Any] = [info.get(k) for k in ("speculative_num_steps", "speculative_eagle_topk",
                                                 "speculative_num_draft_tokens")]
        if all(isinstance(v, int) and v > 0 for v in vals):
            runs = (vals[0], vals[1], vals[2])
    asked = _asked(command, given)
    if runs is not None and asked is not None and asked[0] != runs:
        s, k, n = runs
        raise ServingError(f"{asked[1]} gives steps {asked[0][0]}, topk {asked[0][1]}, num_draft_tokens "
                           f"{asked[0][2]} (as SGLang runs them), but the server's /server_info says it runs {s}, "
                           f"{k}, {n}: pass --sglang {s},{k},{n} or the command the server was started with")
    if runs is not None:
        return Shape(*runs, source="the server's /server_info")
    if asked is not None:
        return Shape(*asked[0], source=asked[1])
    raise ServingError("cannot tell the SGLang server's draft shape: its /server_info gives no "
                       "speculative_num_steps/eagle_topk/num_draft_tokens; pass --sglang STEPS,TOPK,NUM_DRAFT_TOKENS "
                       "or its launch command after --")


# ---- the counts -----------------------------------------------------------------------------------

def histogram_of(per_pos: list[int], rounds: int) -> list[int]:
    """Per-position counts (rounds whose first i+1 drafts were accepted) -> SGLang's accepted-draft histogram
    (rounds that accepted exactly j drafts), trailing empty bins dropped as SGLang grows it."""
    c = [rounds, *per_pos, 0]
    h = [c[j] - c[j + 1] for j in range(len(per_pos) + 1)]
    while h and h[-1] == 0:
        h.pop()
    return h


def per_pos_of(hist: list[int], steps: int) -> list[int]:
    """c[i] = sum_{j>i} h[j], i = 0..steps-1."""
    return [sum(hist[i + 1:]) for i in range(steps)]


def _pad(h: list[int], n: int) -> list[int]:
    return list(h) + [0] * (n - len(h))


@dataclass
class Totals:
    verify_ct: int = 0
    correct: int = 0
    proposed: int = 0
    histogram: list[int] = field(default_factory=list)
    requests: int = 0
    with_details: int = 0

    def add(self, d: dict[str, Any]) -> None:
        """One response's SpecTokensDetails (protocol.py line 456)."""
        self.verify_ct += int(d.get("spec_verify_ct") or 0)
        self.correct += int(d.get("spec_num_correct_drafts") or 0)
        self.proposed += int(d.get("spec_num_proposed_drafts") or 0)
        h = [int(x) for x in d.get("spec_correct_drafts_histogram") or []]
        n = max(len(h), len(self.histogram))
        self.histogram = [a + b for a, b in zip(_pad(self.histogram, n), _pad(h, n), strict=True)]
        self.with_details += 1


def spec_details(out: dict[str, Any], url: str) -> dict[str, Any] | None:
    """sglext.spec_tokens_details of a /v1/completions response (one object for n = 1, a list for n > 1), None
    when absent (SGLang omits it for a request without a verify round)."""
    ext = out.get("sglext")
    d = ext.get("spec_tokens_details") if isinstance(ext, dict) else None
    if isinstance(d, list):
        d = d[0] if d else None
    if d is not None and not isinstance(d, dict):
        raise ServingError(f"{url}/v1/completions: sglext.spec_tokens_details is not an object: {str(d)[:200]!r}")
    return d


def complete_sglang(cl: ServerClient, model: str, ids: list[int], m: int, stop_ids: list[int]
                    ) -> tuple[list[int], dict[str, Any] | None]:
    """One greedy completion of a token-id prompt -> (the new token ids, its spec_tokens_details)."""
    body = {"model": model, "prompt": ids, "max_tokens": m, "temperature": 0.0, "stop_token_ids": stop_ids,
            "return_token_ids": True, "return_spec_tokens_details": True, "skip_special_tokens": False}
    out = cl.post_json("/v1/completions", body, f"a {m}-token completion")
    try:
        toks = out["choices"][0].get("token_ids")
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        raise ServingError(f"{cl.url}/v1/completions answered without choices: {str(out)[:200]!r}") from e
    if not isinstance(toks, list):
        raise ServingError(f"{cl.url}/v1/completions returned no choices[0].token_ids (return_token_ids): an SGLang "
                           f"older than this check knows (it reads {VERIFIED}'s fields)")
    return [int(t) for t in toks], spec_details(out, cl.url)


def send_rows_sglang(cl: ServerClient, model: str, rows: ReplayRows, m: int, say: Callable[[str], None]
                     ) -> tuple[list[list[int]], Totals, str | None]:
    """Each row's prompt sent greedily for m tokens -> (new tokens per row, the summed counts, why a request
    failed or None)."""
    got: list[list[int]] = []
    tot = Totals()
    for i in range(len(rows)):
        ids = rows.prompt(i)
        say(f"prompt {i + 1}/{len(rows)}: {len(ids)} tokens -> server")
        try:
            toks, d = complete_sglang(cl, model, ids, m, rows.eos)
        except ServingError as e:
            return got, tot, str(e)
        got.append(toks)
        tot.requests += 1
        if d is not None:
            tot.add(d)
    return got, tot, None


def check_counts(tot: Totals, shape: Shape, got: list[list[int]], url: str) -> None:
    """The counts must describe the shape the replay runs, or the comparison means nothing: one line if not."""
    if tot.with_details == 0:
        if any(len(g) > 1 for g in got):
            raise ServingError(f"{url}: no response carried sglext.spec_tokens_details although replies ran past "
                               "their first token: speculation is off for these requests, or the server is an "
                               f"SGLang older than the field (eyas reads {VERIFIED}'s return_spec_tokens_details)")
        raise ServingError(f"{url}: every reply ended at its first token, so no verify round ran; raise "
                           "--max-new-tokens")
    if tot.verify_ct and tot.proposed != tot.verify_ct * (shape.num_draft_tokens - 1):
        per = tot.proposed / tot.verify_ct + 1
        raise ServingError(f"the server's counts say it verifies {per:g} tokens per round "
                           f"(spec_num_proposed_drafts {tot.proposed} / spec_verify_ct {tot.verify_ct} + 1), not the "
                           f"{shape.num_draft_tokens} of {shape.source}: pass --sglang with the flags it runs")
    if len(tot.histogram) > shape.steps + 1:
        raise ServingError(f"the server's histogram has rounds that accepted {len(tot.histogram) - 1} drafts, more "
                           f"than the {shape.steps} steps of {shape.source}: pass --sglang with the flags it runs")


# ---- the verdict ----------------------------------------------------------------------------------

def verdict_sglang(tot: Totals, shape: Shape, right: Counts, plants: dict[str, Counts], same_tokens: bool,
                   facts, flags_fail: str | None) -> Verdict:
    """judge() on the per-position counts (c[i] from the histogram, rounds = spec_verify_ct), then the histogram
    and the totals themselves count for count: a histogram or a correct-drafts total that disagrees where the
    per-position counts agree is a server whose counts are not self-consistent."""
    per = per_pos_of(tot.histogram, shape.steps)
    srv = SpecCounters(float(tot.verify_ct), float(tot.proposed), float(tot.correct), [float(x) for x in per])
    v = judge(srv, right, plants, same_tokens, facts, flags_fail)
    if v.status != "pass" or not same_tokens:
        return v
    rh = histogram_of(right[0], right[1])
    n = max(len(rh), len(tot.histogram))
    if _pad(tot.histogram, n) == _pad(rh, n) and tot.correct == sum(right[0]):
        return Verdict("pass", f"the server's accepted-draft histogram {tot.histogram} over {tot.verify_ct} verify "
                       f"rounds ({tot.correct} drafts accepted) equals the replay of this draft exactly", v.notes)
    return Verdict("fail", f"the server's histogram {tot.histogram} (summing to {sum(tot.histogram)} rounds) and "
                   f"{tot.correct} accepted drafts over spec_verify_ct {tot.verify_ct} differ from the replay's "
                   f"{rh} and {sum(right[0])} over {right[1]} although the per-position counts agree: the server's "
                   "counts are not self-consistent (a histogram bin or a total off); none of eyas's planted faults "
                   "does that", v.notes)


def check_sglang(url: str, target, draft_spec, rows: ReplayRows, answer: EngineAnswer, given: str | None = None,
                 max_new_tokens: int | None = None, api_key: str | None = None, timeout: float = 120.0,
                 export: Path | None = None, command: list[str] | None = None, diagnose: bool = True,
                 log: Callable[[str], None] | None = None) -> ServingReport:
    """The live check against SGLang: the rows' prompts sent with return_spec_tokens_details, the responses'
    counts summed, and the replay of the draft (and of each planted fault) under the server's flags."""
    from ..draft import load_draft
    from ..replay.run import replay, sglang

    say = log or (lambda _m: None)
    m = rows.max_new_tokens if max_new_tokens is None else max_new_tokens
    if not rows.tokens:
        raise ServingError("the replay rows hold no prompts: capture some with `eyas replay capture`")
    rows.check_target(target.identity, "the --target")
    info = answer.info or {}
    if "speculative_algorithm" in info and not info["speculative_algorithm"]:
        raise ServingError(f"{url} is SGLang without speculative decoding (speculative_algorithm null in its "
                           "/server_info): start it with --speculative-algorithm EAGLE3 --speculative-draft-model-path "
                           "DRAFT")
    shape = resolve_shape(answer.info, command, given)
    ck = load_draft(draft_spec, device="cpu") if isinstance(draft_spec, str) else draft_spec
    checks, flags_fail = flags_checks(command, export, shape.steps, target.num_layers)
    notes: list[str] = []
    algo = str(info.get("speculative_algorithm") or "")
    if algo and algo.upper() != "EAGLE3":
        flags_fail = flags_fail or (f"the server runs speculative_algorithm {algo}: only EAGLE3 feeds the draft the "
                                    "target's aux states; restart it with --speculative-algorithm EAGLE3")
    if answer.version and answer.version != VERIFIED:
        notes.append(f"this server is SGLang {answer.version}; eyas read these fields and counting rules in "
                     f"{VERIFIED}'s code")
    facts = export_facts(export, ck) if export is not None else None
    cl = ServerClient(url, api_key, timeout)
    try:
        model = cl.model()
        t0 = time.perf_counter()
        got, tot, failed = send_rows_sglang(cl, model, rows, m, say)
        seconds = {"server": time.perf_counter() - t0}
    finally:
        cl.close()
    base: dict[str, Any] = dict(url=cl.url, model=model, k=shape.steps, prompts=len(rows), max_new_tokens=m,
                rows={"path": str(rows.path) if rows.path else None, "numerics": rows.numerics,
                      "streams": rows.streams}, flags=[c.to_dict() for c in checks],
                export=asdict(facts) if facts else None, engine="sglang",
                sglang={"version": answer.version, "how": answer.how, "steps": shape.steps, "topk": shape.topk,
                        "num_draft_tokens": shape.num_draft_tokens, "shape_from": shape.source})
    if failed is not None:
        cause = (f"; doctor flags names the cause: {flags_fail}" if flags_fail else
                 "; read the server's log, and pass its launch command after -- so eyas can lint it")
        v = Verdict("fail", f"the server failed a request ({failed}){cause}")
        return ServingReport(**base, server={}, replay={}, plants={}, same_tokens=0, verdict=v, reproduced_by=None,
                             seconds=seconds, notes=notes)
    check_counts(tot, shape, got, cl.url)
    same = sum(g == rows.reply(i, m) for i, g in enumerate(got))
    spec = sglang(shape.steps, shape.topk, shape.num_draft_tokens)
    say(f"replay: SGLang steps {shape.steps}, topk {shape.topk}, num_draft_tokens {shape.num_draft_tokens} on the "
        f"{len(rows)} rows")
    t0 = time.perf_counter()
    res = replay(rows, target, ck, spec, m)
    seconds["replay"] = time.perf_counter() - t0
    right = res.counts()
    counts = (per_pos_of(tot.histogram, shape.steps), tot.verify_ct)
    plants: dict[str, Counts] = {}
    if diagnose and (counts != right or histogram_of(*right) != tot.histogram or tot.correct != sum(right[0])):
        t0 = time.perf_counter()
        for f in FAULTS:
            say(f"replay with a planted fault: {f.name}")
            plants[f.name] = replay(rows, target, ck, spec, m, plant=f.plant).counts()
        seconds["plants"] = time.perf_counter() - t0
    verdict = verdict_sglang(tot, shape, right, plants, same == len(rows), facts, flags_fail)
    repro = next((n for n, c in plants.items() if c == counts and n != "untrained"), None)
    server, rep_d = _summaries(tot, counts, got, res, right, shape)
    return ServingReport(**base, server=server, replay=rep_d,
                         plants={n: {"per_pos": c[0], "rounds": c[1], "histogram": histogram_of(*c)}
                                 for n, c in plants.items()},
                         same_tokens=same, verdict=verdict, reproduced_by=repro, seconds=seconds,
                         notes=notes + verdict.notes)


def _summaries(tot, counts: Counts, got: list, res, right: Counts, shape) -> tuple[dict[str, Any], dict[str, Any]]:
    """The report's server and replay sides: per-position counts, rates, τ and SGLang's own totals."""
    rates = [a / tot.verify_ct if tot.verify_ct else 0.0 for a in counts[0]]
    server = {"drafts": tot.verify_ct, "per_pos": counts[0], "rates": rates,
              "tau": 1 + tot.correct / tot.verify_ct if tot.verify_ct else 0.0, "histogram": tot.histogram,
              "verify_ct": tot.verify_ct, "num_correct_drafts": tot.correct, "num_proposed_drafts": tot.proposed,
              "requests_with_details": tot.with_details, "new_tokens": sum(len(g) for g in got)}
    rep_d = {"per_pos": res.per_pos, "rounds": res.rounds, "rates": res.rates, "tau": res.tau,
             "histogram": histogram_of(*right), "num_correct_drafts": sum(res.per_pos),
             "num_proposed_drafts": res.rounds * (shape.num_draft_tokens - 1)}
    return server, rep_d
