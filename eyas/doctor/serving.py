"""`eyas doctor serving`: measure a running vLLM server's EAGLE-3 acceptance against the replay of the same draft.

High validation accuracy in training and a poor accept length in serving is the failure this answers in one
command: it reads the server's spec-decode counters, sends the replay rows' prompts (token ids, greedy), reads the
counters again, and compares the per-position accepted counts with the replay of the draft on those rows
(eyas.replay: the target's greedy replies and stream states captured once, the draft run alone through eyas's
engine; any target whose features can be captured, MoE and MLA included). With the same numerics (vLLM's CPU
build on fp32 weights, rows captured in fp32) the counts are equal, token for token; a wiring fault leaves a
signature, and each known fault is replayed planted (eyas.replay.plants) to name the one that reproduces the
server's counts. Given the launch command or the export folder, `doctor flags` runs first, so a server that
dies on its first request (no "method": "eagle3") is named.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import EyasError
from ..replay.plants import FAULTS
from ..replay.rows import ReplayRows
from .checklist import Check
from .server import PER_POS, ServerClient, ServingError, SpecCounters

# Verdict thresholds. Same numerics (vLLM CPU, fp32): counts are equal. Other numerics (a GPU, bf16) change a
# few greedy tokens and with them the rounds, so a per-position acceptance rate within RATE_TOL (absolute) of
# the replay's is still "close" when no planted fault is nearer. Measured spread of the right export (the shipped
# draft, k = 3, 64 tokens; benchmarks/dtype_spread.py): vLLM CPU bf16 against the fp32 replay, at most 0.020 on 8
# MT-bench questions and 0.024 on 16 others; 0.10 leaves room for GPU kernels, which were not measured. A wiring
# fault that moves less than that (a shift by one: 0.01 on this draft) is listed as not distinguishable.
RATE_TOL = 0.10
NEAR_ZERO = 0.05  # position-0 acceptance below this: the drafted tokens are not the target's tokens at all
COLLAPSE = 0.6  # server position-0 rate below this fraction of eyas's: the draft's input features are wrong


# ---- the prediction: replay ------------------------------------------------------------------------

Counts = tuple[list[int], int]  # accepted per draft position, rounds (vLLM: drafts)


@dataclass
class ExportFacts:
    """What the folder the server loads says directly (--export): its d2t and whether its weights are the draft's."""
    path: str
    d2t: str  # present | missing | zero | differs
    weights: str  # same | differ | unknown

    def line(self) -> str:
        return f"the export {self.path}: d2t {self.d2t}, weights {self.weights} (vs --draft)"


def export_facts(export: Path, ck) -> ExportFacts:
    """Read the export's safetensors: is d2t there and equal to the draft's, are fc and lm_head the draft's."""
    from safetensors import safe_open

    files = sorted(Path(export).glob("*.safetensors"))
    if not files:
        raise ServingError(f"--export {export}: no *.safetensors in that folder; pass the folder the server's "
                           "speculative config points at")
    found: dict[str, Any] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    base = key.split(".", 1)[1] if key.startswith(("model.", "draft.")) else key
                    if base in ("d2t", "fc.weight", "lm_head.weight"):
                        found[base] = sf.get_tensor(key)
        except Exception as e:  # noqa: BLE001 - a damaged export is one line
            raise ServingError(f"--export {export}: {f.name} is not readable safetensors ({e})") from e
    d = ck.model.d2t.cpu()
    d2t = found.get("d2t")
    if d2t is None:
        d2t_s = "missing"
    elif not bool(d2t.any()):
        d2t_s = "zero"
    else:
        d2t_s = "present" if d2t.shape == d.shape and bool((d2t.long() == d).all()) else "differs"
    weights = "unknown"
    if "fc.weight" in found and "lm_head.weight" in found:
        same = all(found[n].shape == w.shape and torch.allclose(found[n].float(), w.detach().float().cpu(), atol=1e-2,
                                                               rtol=1e-2)
                   for n, w in (("fc.weight", ck.model.fc.weight), ("lm_head.weight", ck.model.lm_head.weight)))
        weights = "same" if same else "differ"
    return ExportFacts(str(export), d2t_s, weights)


# ---- the verdict ----------------------------------------------------------------------------------

@dataclass
class Verdict:
    status: str  # pass | fail
    line: str  # one line: the result, or the likely cause
    notes: list[str] = field(default_factory=list)


def _rates(c: Counts) -> list[float]:
    return [a / c[1] if c[1] else 0.0 for a in c[0]]


def _dist(a: Counts, b: Counts) -> float:
    return sum(abs(x - y) for x, y in zip(_rates(a), _rates(b), strict=True))


def judge(server: SpecCounters, right: Counts, plants: dict[str, Counts], same_tokens: bool,
          export: ExportFacts | None = None, flags_fail: str | None = None) -> Verdict:
    """The server's per-position accepted counts over this check's traffic against the replay of the draft as
    given (`right`) and of each planted fault (`plants`, by FAULTS name).

    Same numerics (the server's greedy tokens equal the rows'): equal means equal. Equal to `right` passes; a
    fault whose replay gives the server's exact counts fails with its cause; any other difference fails too,
    naming the nearest fault. Nothing accepted at all is reproduced by both a missing d2t and an untrained draft:
    the export's own d2t and weights (--export) tell them apart. Other numerics (tokens differ: bf16, a GPU):
    the nearest of the draft and the faults by acceptance rates decides; the draft passes when every position's
    rate is within RATE_TOL of the replay's."""
    by_name = {f.name: f for f in FAULTS}
    notes: list[str] = []
    if not same_tokens:
        notes.append("the server's greedy tokens differ from the rows' on some prompt: its target numerics differ "
                     f"(dtype, kernels, GPU), so counts can only be close: tolerance {RATE_TOL:g} in acceptance "
                     "rate per position (docs/CLI.md, doctor serving)")
    if flags_fail:
        notes.append(f"doctor flags: {flags_fail}")
    if server.drafts <= 0:
        return Verdict("fail", "the server drafted nothing during the check: speculative decoding is off for these "
                       "requests (or the draft never ran); check --speculative-config", notes)
    counts: Counts = ([int(round(v)) for v in server.per_pos], int(round(server.drafts)))
    mine = _rates(right)
    srv = _rates(counts)
    exact = "the server's accepted counts per position {} over {} drafts".format(*counts)
    if counts == right:
        return Verdict("pass", f"{exact} equal the replay of this draft exactly", notes)
    if sum(counts[0]) == 0 and sum(right[0]) > 0:
        d2t, untrained = by_name["d2t_missing"], by_name["untrained"]
        if export is None:
            return Verdict("fail", f"nothing accepted ({counts[1]} drafts; the replay accepts {sum(right[0])}): "
                           "either the vocab map (d2t) is missing or the server's draft is untrained or foreign; "
                           "pass --export DIR (the folder the server loads) to tell which", notes)
        if export.d2t in ("missing", "zero"):
            return Verdict("fail", f"{d2t.cause} (the export's d2t is {export.d2t}; nothing accepted over "
                           f"{counts[1]} drafts)", notes)
        if export.d2t == "differs" or export.weights == "differ":
            what = "d2t" if export.d2t == "differs" else "weights (fc, lm_head)"
            return Verdict("fail", f"{untrained.cause} (the export's {what} differ from --draft's; nothing accepted "
                           f"over {counts[1]} drafts)", notes)
        return Verdict("fail", f"nothing accepted over {counts[1]} drafts although the export carries this draft's "
                       "d2t and weights: the server does not feed the draft the target's aux states (method other "
                       "than eagle3, or ids outside the target); run `eyas doctor flags` on its command", notes)
    repro = [f for f in FAULTS if plants.get(f.name) == counts and f.name != "untrained"]
    if repro:
        f = repro[0]
        return Verdict("fail", f"{f.cause} (replayed with that fault planted, the draft gives {exact} exactly; as "
                       f"given: {right[0]} over {right[1]})", notes)
    ranked = sorted(((_dist(counts, c), n) for n, c in plants.items() if n != "untrained"), key=lambda t: t[0])
    nearest = f"; nearest fault {ranked[0][1]} {plants[ranked[0][1]][0]} over {plants[ranked[0][1]][1]}" \
        if ranked else ""
    if same_tokens:
        return Verdict("fail", f"{exact} differ from the replay's {right[0]} over {right[1]} although the greedy "
                       "tokens are identical (same numerics: the counts must be equal); none of eyas's planted "
                       f"faults reproduces them{nearest}: {_signature(srv, mine)}", notes)
    # other numerics: a fault can be told from the draft only where its replay moves a rate by more than the
    # tolerance; among those, one nearer the server than the draft is the finding
    def off(c: Counts) -> float:
        return max(abs(a - b) for a, b in zip(_rates(c), mine, strict=True))

    blind = [n for n, c in plants.items() if n != "untrained" and off(c) <= RATE_TOL]
    if blind:
        notes.append(f"under other numerics these faults stay within the tolerance of the draft on these prompts and "
                     f"cannot be told apart from it: {', '.join(blind)}; check with equal numerics (fp32) to rule them "
                     "out")
    told = [(d, n) for d, n in ranked if n not in blind]
    if told and told[0][0] < _dist(counts, right):
        f = by_name[told[0][1]]
        return Verdict("fail", f"{f.cause} (its replay is nearer the server's acceptance {_fmt(srv)} than the draft "
                       f"as given {_fmt(mine)})", notes)
    if all(abs(s - m) <= RATE_TOL for s, m in zip(srv, mine, strict=True)):
        return Verdict("pass", f"the server's acceptance per position {_fmt(srv)} is within {RATE_TOL:g} of the "
                       f"replay's {_fmt(mine)} (counts {counts[0]} vs {right[0]}), and nearer it than any planted "
                       "fault's", notes)
    return Verdict("fail", _signature(srv, mine), notes)


def _signature(srv: list[float], mine: list[float]) -> str:
    """The likely cause read from where the acceptance differs."""
    if srv[0] > mine[0] + RATE_TOL:
        return (f"likely another draft: the server accepts more at position 0 ({srv[0]:.2f}) than the replay of this "
                f"draft ({mine[0]:.2f}); pass the draft the server loads as --draft")
    if srv[0] < NEAR_ZERO <= mine[0]:
        return (f"likely the draft->target vocab map (d2t): position-0 acceptance {srv[0]:.2f} vs {mine[0]:.2f}, near "
                "zero: the drafted tokens are not the target's; check that the export carries d2t")
    if srv[0] < COLLAPSE * mine[0]:
        return (f"likely the feature wiring (aux layer ids / layer convention, or a method other than eagle3): "
                f"position-0 acceptance {srv[0]:.2f} vs {mine[0]:.2f}; compare the export's "
                "eagle_aux_hidden_state_layer_ids with `eyas doctor flags`")
    diff = [s - m for s, m in zip(srv, mine, strict=True)]
    worst = max(range(len(diff)), key=lambda i: abs(diff[i]))
    if worst == 0 or abs(diff[worst]) < 1e-9:
        return (f"likely the feature wiring or the draft's numerics: position-0 acceptance {srv[0]:.2f} vs the "
                f"replay's {mine[0]:.2f}")
    return (f"likely the draft's later steps (its fed-back hidden state, RoPE or norm config): position 0 agrees "
            f"({srv[0]:.2f} vs {mine[0]:.2f}) but position {worst} does not ({srv[worst]:.2f} vs {mine[worst]:.2f})")


def _fmt(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.2f}" for x in xs) + "]"


# ---- the whole check ------------------------------------------------------------------------------

@dataclass
class ServingReport:
    url: str
    model: str
    k: int
    prompts: int
    max_new_tokens: int
    rows: dict[str, Any]  # where the rows came from (folder, numerics)
    server: dict[str, Any]  # this check's counter differences
    replay: dict[str, Any]  # the draft as given
    plants: dict[str, Any]  # fault name -> {per_pos, rounds}
    same_tokens: int  # prompts whose greedy tokens equal the rows' replies
    verdict: Verdict
    reproduced_by: str | None  # the planted fault whose replay equals the server's counts
    flags: list[dict[str, Any]]  # doctor flags' checks on the launch command / export
    export: dict[str, Any] | None
    seconds: dict[str, float]
    notes: list[str]
    engine: str = "vllm"  # which engine answered: vllm | sglang
    sglang: dict[str, Any] | None = None  # SGLang: its version and the draft shape it runs (eyas.doctor.sglang_counts)

    @property
    def ok(self) -> bool:
        return self.verdict.status == "pass"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def flags_checks(command: list[str] | None, export: Path | None, k: int | None, num_layers: int
                 ) -> tuple[list[Check], str | None]:
    """doctor flags on the launch command (its --speculative-config model is the export) or, with --export alone,
    on the export's config as vLLM would read it; -> (checks, the first failure's summary)."""
    from .flags import lint_serve_command
    from .launch_command import FlagsError, parse_serve_command

    if not command and export is None:
        return [], None
    argv = list(command or [])
    folder = export
    if argv and folder is None:
        try:
            spec = parse_serve_command(argv).spec_config or {}
        except FlagsError as e:
            raise ServingError(f"the launch command after --: {e}") from e
        folder = Path(spec["model"]) if spec.get("model") else None
    if folder is None:
        return [], None
    synthetic = not argv
    if synthetic:  # the export's own config, read as the eagle3 method would: only its ids and paths are checked
        argv = ["vllm", "serve", "TARGET", "--speculative-config",
                json.dumps({"method": "eagle3", "model": str(folder), "num_speculative_tokens": k or 3})]
    try:
        lint = lint_serve_command(argv, folder, num_layers)
    except EyasError as e:  # an export that cannot be read as a draft is itself a finding, not the end of the check
        return [Check("export", "fail", str(e))], f"export: {e}"

    checks = [c for c in lint.checks if not synthetic or c.name not in ("method", "num_speculative_tokens")]
    bad = next((c for c in checks if c.status == "fail"), None)
    return checks, (f"{bad.name}: {bad.summary}" if bad else None)


@dataclass
class Sent:
    url: str
    model: str
    k: int
    got: list[list[int]]  # the server's new tokens per row
    failed: str | None  # why a request failed (the server died, say), else None
    before: SpecCounters
    after: SpecCounters
    seconds: float


def send_rows(url: str, rows: ReplayRows, m: int, k: int | None, api_key: str | None, timeout: float,
              say: Callable[[str], None]) -> Sent:
    """The counters, each row's prompt sent greedily for m tokens, the counters again."""
    cl = ServerClient(url, api_key, timeout)
    try:
        before = cl.counters()
        if k is not None and k != before.k:
            raise ServingError(f"--k {k}, but the server drafts {before.k} tokens per round (its "
                               f"{PER_POS} positions 0..{before.k - 1}); drop --k or pass --k {before.k}")
        model = cl.model()
        t0 = time.perf_counter()
        got: list[list[int]] = []
        failed: str | None = None
        for i in range(len(rows)):
            ids = rows.prompt(i)
            say(f"prompt {i + 1}/{len(rows)}: {len(ids)} tokens -> server")
            try:
                got.append(cl.complete(model, ids, m, rows.eos))
            except ServingError as e:
                failed = str(e)
                break
        dt = time.perf_counter() - t0
        after = cl.counters() if failed is None else before
    finally:
        cl.close()
    return Sent(cl.url, model, before.k, got, failed, before, after, dt)


def check_server(url: str, target, draft_spec: str, rows: ReplayRows, k: int | None = None,
                 max_new_tokens: int | None = None, api_key: str | None = None, timeout: float = 120.0,
                 export: Path | None = None, command: list[str] | None = None, diagnose: bool = True,
                 log: Callable[[str], None] | None = None) -> ServingReport:
    """The live check: the rows' prompts to the server, its counters read before and after, and the replay of
    the draft (and of each planted fault) on the rows. `target` is the served model (weights not needed)."""
    from ..draft import load_draft
    from ..replay.run import chain, replay

    say = log or (lambda _m: None)
    m = rows.max_new_tokens if max_new_tokens is None else max_new_tokens
    if not rows.tokens:
        raise ServingError("the replay rows hold no prompts: capture some with `eyas replay capture`")
    rows.check_target(target.identity, "the --target")
    ck = load_draft(draft_spec, device="cpu")
    checks, flags_fail = flags_checks(command, export, k, target.num_layers)
    facts = export_facts(export, ck) if export is not None else None
    sent = send_rows(url, rows, m, k, api_key, timeout, say)
    k, model, got, failed, before, after = sent.k, sent.model, sent.got, sent.failed, sent.before, sent.after
    seconds = {"server": sent.seconds}
    base: dict[str, Any] = dict(url=sent.url, model=model, k=k, prompts=len(rows), max_new_tokens=m,
                rows={"path": str(rows.path) if rows.path else None, "numerics": rows.numerics,
                      "streams": rows.streams}, flags=[c.to_dict() for c in checks],
                export=asdict(facts) if facts else None)
    if failed is not None:
        cause = (f"; doctor flags names the cause: {flags_fail}" if flags_fail else
                 "; read the server's log, and pass its launch command after -- so eyas can lint it")
        v = Verdict("fail", f"the server failed a request ({failed}){cause}")
        return ServingReport(**base, server={}, replay={}, plants={}, same_tokens=0, verdict=v, reproduced_by=None,
                             seconds=seconds, notes=[])
    delta = after.minus(before)
    notes = ["the counters are server-wide: other requests during the check add to them; run it on an otherwise "
             "idle server"]
    sent_new = sum(len(t) for t in got)
    if delta.generation_tokens is not None and delta.generation_tokens > sent_new:
        notes.append(f"other traffic was present: the server generated {delta.generation_tokens:.0f} tokens during "
                     f"the check, this check asked for {sent_new}; the comparison below is polluted")
    same = sum(g == rows.reply(i, m) for i, g in enumerate(got))
    say(f"replay: chain of {k} on the {len(rows)} rows")
    t0 = time.perf_counter()
    right = replay(rows, target, ck, chain(k), m)
    seconds["replay"] = time.perf_counter() - t0
    counts = ([int(round(v)) for v in delta.per_pos], int(round(delta.drafts)))
    plants: dict[str, Counts] = {}
    if diagnose and counts != right.counts():
        t0 = time.perf_counter()
        for f in FAULTS:
            say(f"replay with a planted fault: {f.name}")
            plants[f.name] = replay(rows, target, ck, chain(k), m, plant=f.plant).counts()
        seconds["plants"] = time.perf_counter() - t0
    verdict = judge(delta, right.counts(), plants, same == len(rows), facts, flags_fail)
    repro = next((n for n, c in plants.items() if c == counts and n != "untrained"), None)
    srv_d = {**asdict(delta), "rates": delta.rates(), "tau": delta.tau(), "new_tokens": sent_new}
    srv_d = {k_: (None if isinstance(v, float) and math.isnan(v) else v) for k_, v in srv_d.items()}
    return ServingReport(**base, server=srv_d,
                         replay={"per_pos": right.per_pos, "rounds": right.rounds, "rates": right.rates,
                                 "tau": right.tau},
                         plants={n: {"per_pos": c[0], "rounds": c[1]} for n, c in plants.items()},
                         same_tokens=same, verdict=verdict, reproduced_by=repro, seconds=seconds,
                         notes=notes + verdict.notes)


def render_serving(rep: ServingReport, echo: Callable[[str], None] = print) -> None:
    shape = "SGLang" if rep.engine == "sglang" else f"vLLM, k = {rep.k}"
    echo(f"server {rep.url} ({shape}, model {rep.model}), {rep.prompts} prompts x {rep.max_new_tokens} tokens; "
         f"rows {rep.rows.get('path') or '(captured now)'} ({rep.rows.get('numerics')})")
    if rep.engine == "sglang":
        for line in sglang_lines(rep):
            echo(line)
    for c in rep.flags:
        if c["status"] != "pass":
            echo(f"  flags {c['status']}: {c['name']}: {c['summary']}")
    if rep.export:
        echo(f"  export {rep.export['path']}: d2t {rep.export['d2t']}, weights {rep.export['weights']}")
    s, e = rep.server, rep.replay
    if s:
        echo(f"  server: drafts {s['drafts']:.0f}, accepted per position {[int(round(v)) for v in s['per_pos']]}, "
             f"rate {_fmt(s['rates'])}, tau {s['tau']:.2f}")
    if e:
        echo(f"  replay: drafts {e['rounds']}, accepted per position {e['per_pos']}, rate {_fmt(e['rates'])}, "
             f"tau {e['tau']:.2f}")
        echo(f"  greedy tokens equal to the rows' on {rep.same_tokens}/{rep.prompts} prompts")
    for name, c in rep.plants.items():
        mark = "  <- reproduces the server's counts" if name == rep.reproduced_by else ""
        hist = f" (histogram {c['histogram']})" if "histogram" in c else ""
        echo(f"  planted {name}: {c['per_pos']} over {c['rounds']}{hist}{mark}")
    for n in rep.notes:
        echo(f"  note: {n}")
    echo(f"{rep.verdict.status.upper()}: {rep.verdict.line}")


def sglang_lines(rep: ServingReport) -> list[str]:
    """The report's SGLang-only lines: the shape it runs and the histograms side by side."""
    g = rep.sglang or {}
    out = [f"  SGLang {g.get('version') or '?'}: steps {g.get('steps')}, topk {g.get('topk')}, num_draft_tokens "
           f"{g.get('num_draft_tokens')} (from {g.get('shape_from')}); counts per request from "
           "sglext.spec_tokens_details, so other traffic does not touch them"]
    s, e = rep.server, rep.replay
    if s:
        out.append(f"  server: histogram {s['histogram']} (rounds accepting j = 0.. drafts), spec_verify_ct "
                   f"{s['verify_ct']}, spec_num_correct_drafts {s['num_correct_drafts']}, spec_num_proposed_drafts "
                   f"{s['num_proposed_drafts']}")
    if e:
        out.append(f"  replay: histogram {e['histogram']}, rounds {e['rounds']}, correct {e['num_correct_drafts']}, "
                   f"proposed {e['num_proposed_drafts']}")
    return out
