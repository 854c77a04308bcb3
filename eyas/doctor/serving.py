"""`eyas doctor serving`: measure a running vLLM server's EAGLE-3 acceptance against eyas's own prediction.

High validation accuracy in training and a poor accept length in serving is the failure this answers in one
command: it reads the server's spec-decode counters, sends a few prompts (token ids, greedy), reads the counters
again, and compares the per-position accepted counts with what eyas's engine predicts for the same draft, the
same token ids, the same number of new tokens and the same chain length (method chain, k = the server's
num_speculative_tokens, fp32 weights). With the same numerics (vLLM's CPU build on the HF fp32 weights) the
counts are equal, token for token; a wiring fault leaves a signature, and eyas re-runs its engine with each
known fault planted to name the one that reproduces the server's counts.

vLLM (read in vllm/v1/spec_decode/metrics.py SpecDecodingProm, vLLM 0.32): Prometheus counters
`vllm:spec_decode_num_drafts`, `vllm:spec_decode_num_draft_tokens`, `vllm:spec_decode_num_accepted_tokens`,
and `vllm:spec_decode_num_accepted_tokens_per_pos` with a `position` label 0..k-1, created for every position
when the server starts (so k is readable before any traffic); prometheus_client writes counters with a
`_total` suffix. Labels also carry the model name and the engine index (one series per data-parallel engine:
summed here). SpecDecodingStats.observe_draft counts position i as accepted when the first i+1 drafted tokens
were accepted — eyas's GenStats.accepted_per_depth[i].

SGLang (python/sglang/srt/metrics/collector.py) exports `sglang:spec_accept_length` / `sglang:spec_accept_rate`
as gauges averaged over its last logging interval, with no per-position counter, so a difference over one
check's traffic cannot be taken: it is refused in one line.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import EyasError

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"

# Verdict thresholds. Same numerics (vLLM CPU, fp32): counts are equal. Other numerics (a GPU, bf16) change a
# few greedy tokens and with them the rounds, so a per-position acceptance rate within RATE_TOL (absolute) of
# eyas's is still "close"; a wiring fault moves position 0 by far more (measured on SmolLM2-135M: aux ids
# shifted by one 0.43 -> 0.1x, d2t dropped -> ~0).
RATE_TOL = 0.10
MAX_BODY = 32 << 20  # bytes read from one GET at most
NEAR_ZERO = 0.05  # position-0 acceptance below this: the drafted tokens are not the target's tokens at all
COLLAPSE = 0.6  # server position-0 rate below this fraction of eyas's: the draft's input features are wrong


class ServingError(EyasError):
    """The server cannot be checked (unreachable, not vLLM, no spec-decode metrics); the message says why."""


# ---- Prometheus text ------------------------------------------------------------------------------

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> {sample name: [(labels, value), ...]}. Comments and lines that are not
    samples are skipped; values keep Prometheus's spellings (NaN, +Inf)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, _, labels, value = m.group(1), m.group(2), m.group(3) or "", m.group(4)
        try:
            v = float(value)
        except ValueError:
            continue
        # the exposition format escapes only backslash, double quote and newline in label values
        lab = {k: re.sub(r"\\(.)", lambda e: "\n" if e.group(1) == "n" else e.group(1), val)
               for k, val in _LABEL.findall(labels)}
        out.setdefault(name, []).append((lab, v))
    return out


def _total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float | None:
    """A counter summed over its label sets (data-parallel engines); prometheus_client adds `_total`."""
    rows = samples.get(name + "_total", samples.get(name))
    return None if rows is None else sum(v for _, v in rows)


@dataclass
class SpecCounters:
    drafts: float
    draft_tokens: float
    accepted: float
    per_pos: list[float]  # accepted tokens at draft position i (0-based)
    prompt_tokens: float | None = None
    generation_tokens: float | None = None

    @property
    def k(self) -> int:
        return len(self.per_pos)

    def minus(self, before: SpecCounters) -> SpecCounters:
        if before.k != self.k:
            raise ServingError(f"the server's draft positions changed between two reads ({before.k} -> {self.k}): "
                               "it restarted with another num_speculative_tokens; run the check again")
        def sub(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else a - b

        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted,
                            [a - b for a, b in zip(self.per_pos, before.per_pos, strict=True)],
                            sub(self.prompt_tokens, before.prompt_tokens),
                            sub(self.generation_tokens, before.generation_tokens))

    def rates(self) -> list[float]:
        return [a / self.drafts if self.drafts else 0.0 for a in self.per_pos]

    def tau(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 0.0


def spec_counters(text: str, url: str = "the server") -> SpecCounters:
    """The spec-decode counters of a vLLM /metrics page; a ServingError naming what the page is instead."""
    s = parse_prometheus(text)
    if not s:
        raise ServingError(f"{url}/metrics is not Prometheus text (no samples in {len(text)} bytes): not a vLLM "
                           "server, or a proxy answering for it; point --url at vLLM's own address")
    if any(n.startswith("sglang:") for n in s):
        raise ServingError(f"{url} is an SGLang server: SGLang exports acceptance only as gauges averaged over its "
                           "last log interval (sglang:spec_accept_length), with no per-position counter, so eyas "
                           "doctor serving supports vLLM only for now; check the flags with `eyas doctor flags`")
    if not any(n.startswith("vllm:") for n in s):
        raise ServingError(f"{url}/metrics has no vllm:* metrics ({len(s)} other series, e.g. {sorted(s)[0]}): not a "
                           "vLLM server; point --url at a `vllm serve` address")
    per: dict[int, float] = {}
    for lab, v in s.get(PER_POS + "_total", s.get(PER_POS, [])):
        if lab.get("position", "").isdigit():
            per[int(lab["position"])] = per.get(int(lab["position"]), 0.0) + v
    drafts, dtok, acc = _total(s, DRAFTS), _total(s, DRAFT_TOKENS), _total(s, ACCEPTED)
    if drafts is None or dtok is None or acc is None or not per:
        raise ServingError(f"{url} is vLLM but exports no spec-decode counters ({DRAFTS}_total, {PER_POS}_total): "
                           "it runs without speculative decoding; start it with --speculative-config "
                           "'{\"method\": \"eagle3\", \"model\": DRAFT, \"num_speculative_tokens\": 3}'")
    if sorted(per) != list(range(len(per))):
        raise ServingError(f"{url}: {PER_POS} has positions {sorted(per)}, expected 0..k-1; an unknown vLLM "
                           "metrics layout")
    return SpecCounters(drafts, dtok, acc, [per[i] for i in range(len(per))], _total(s, PROMPT_TOKENS),
                        _total(s, GENERATION_TOKENS))


# ---- the server -----------------------------------------------------------------------------------

class ServerClient:
    """The few OpenAI-compatible calls the check makes (httpx, no retries: a failure is reported, not hidden)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 120.0):
        import httpx

        if not re.match(r"^https?://[^\s/]+", url or ""):
            raise ServingError(f"--url {url!r}: expected the server's base address, e.g. http://127.0.0.1:8000")
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]  # accept the OpenAI base URL clients are configured with
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, follow_redirects=False)
        self.timeout = timeout

    def close(self) -> None:
        self.http.close()

    def _get(self, path: str) -> str:
        """The body of GET path, read up to MAX_BODY bytes (a vLLM /metrics page is ~100 kB; a hostile or wrong
        server must not make the check read without end)."""
        import httpx

        try:
            with self.http.stream("GET", path) as r:
                if r.status_code >= 400:  # the start of the body is enough for the message
                    self._status(r, path, next(r.iter_bytes(), b"")[:200].decode("utf-8", errors="replace"))
                body = b""
                for chunk in r.iter_bytes():
                    body += chunk
                    if len(body) > MAX_BODY:
                        raise ServingError(f"{self.url}{path} sent more than {MAX_BODY >> 20} MiB: not a vLLM "
                                           "metrics page; point --url at the vLLM server itself")
                return body.decode("utf-8", errors="replace")
        except httpx.TimeoutException as e:
            raise ServingError(f"{self.url}{path} did not answer within --timeout {self.timeout:g} s; is the server "
                               "busy or still loading? raise --timeout") from e
        except httpx.HTTPError as e:
            raise ServingError(f"cannot reach {self.url} ({type(e).__name__}: {str(e)[:120] or 'no detail'}); is "
                               "the server running at that address and port?") from e

    def _status(self, r, path: str, body: str = "") -> None:
        if r.status_code in (401, 403):
            raise ServingError(f"{self.url}{path} answered {r.status_code} (unauthorized): pass the server's key "
                               "with --api-key")
        if r.status_code == 404:
            raise ServingError(f"{self.url}{path} answered 404: not an OpenAI-compatible vLLM server (vLLM serves "
                               f"{path} by default), or --url points below its root")
        if r.status_code >= 400:
            raise ServingError(f"{self.url}{path} answered HTTP {r.status_code}: {body[:200]!r}")

    def counters(self) -> SpecCounters:
        return spec_counters(self._get("/metrics"), self.url)

    def model(self) -> str:
        try:
            data = json.loads(self._get("/v1/models"))["data"]
            return str(data[0]["id"])
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise ServingError(f"{self.url}/v1/models did not list a model (expected {{\"data\": [{{\"id\": ...}}]}}): "
                               "not an OpenAI-compatible server") from e

    def complete(self, model: str, ids: list[int], max_tokens: int, stop_ids: list[int]) -> list[int]:
        """One greedy completion of a token-id prompt; the new token ids (vLLM's return_token_ids)."""
        import httpx

        body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
                "stop_token_ids": stop_ids, "return_token_ids": True, "skip_special_tokens": False}
        try:
            r = self.http.post("/v1/completions", json=body)
        except httpx.TimeoutException as e:
            raise ServingError(f"{self.url}/v1/completions did not finish a {max_tokens}-token completion within "
                               f"--timeout {self.timeout:g} s; raise --timeout or lower --max-new-tokens") from e
        except httpx.HTTPError as e:
            raise ServingError(f"{self.url}/v1/completions failed ({type(e).__name__}: {str(e)[:120]}); the server "
                               "may have crashed on the request: read its log") from e
        self._status(r, "/v1/completions", r.text)
        try:
            choice = r.json()["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise ServingError(f"{self.url}/v1/completions answered without choices: {r.text[:200]!r}") from e
        toks = choice.get("token_ids")
        if not isinstance(toks, list):
            raise ServingError(f"{self.url}/v1/completions returned no token_ids (return_token_ids): a vLLM too old "
                               "for this check (it needs the request field return_token_ids), or not vLLM")
        return [int(t) for t in toks]


# ---- eyas's prediction ----------------------------------------------------------------------------

@dataclass
class Prediction:
    per_pos: list[int]  # accepted per draft position, summed over the prompts
    rounds: int  # speculative rounds (vLLM: drafts)
    tokens: list[list[int]]  # new tokens per prompt


# a fault eyas can plant in its own copy of the draft: (name, the one-line cause, how to plant it)
Fault = tuple[str, str, Callable[[Any, int], None]]


def _shift(delta: int) -> Callable[[Any, int], None]:
    def plant(ck, L: int) -> None:
        ck.layout.aux_indices = [min(max(k + delta, 0), L) for k in ck.layout.aux_indices]
    return plant


def _drop_d2t(ck, L: int) -> None:
    ck.model.d2t.zero_()  # what vLLM's Eagle3 loader keeps when the weights carry no d2t: draft id = target id


FAULTS: list[Fault] = [
    ("aux_ids_minus_1", "likely the aux layer ids: the server feeds the draft the layers one below the trained ones "
     "(SGLang's output-of ids read by vLLM as input-of); export with `eyas export --format vllm`", _shift(-1)),
    ("aux_ids_plus_1", "likely the aux layer ids: the server feeds the draft the layers one above the trained ones "
     "(input-of ids given +1 again, e.g. eagle_aux_layer_semantics \"sglang\" on vLLM ids); export with `eyas "
     "export --format vllm`", _shift(+1)),
    ("d2t_missing", "likely the draft->target vocab map: the server's draft has no d2t (vLLM then reads draft id i as "
     "target token i), so every drafted token is the wrong one; export with `eyas export --format vllm`, which "
     "writes d2t", _drop_d2t),
]


def predict(target, draft_spec: str, prompts: list[list[int]], k: int, max_new_tokens: int, stop_ids: list[int],
            weights: str = "fp32", plant: Callable[[Any, int], None] | None = None) -> Prediction:
    """eyas's chain of k draft steps on each prompt, greedy; `plant` changes the loaded draft first (a fault)."""
    from ..draft import load_draft
    from ..engine.load import EngineParts, make_engine
    from ..engine.params import SamplingParams, SpecParams

    ck = load_draft(draft_spec, device=str(target.device))
    if plant is not None:
        plant(ck, target.num_layers)
    eng = make_engine(EngineParts(target, ck, None), SpecParams(method="chain", steps=k, weights=weights,
                                                                draft_weights="fp32"))
    eng.eos = set(eng.eos) | set(stop_ids)
    per = [0] * k
    rounds = 0
    toks: list[list[int]] = []
    for ids in prompts:
        res = eng.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
        per = [a + b for a, b in zip(per, res.stats.accepted_per_depth[:k], strict=True)]
        rounds += res.stats.rounds
        toks.append(list(res.token_ids))
    return Prediction(per, rounds, toks)


# ---- the verdict ----------------------------------------------------------------------------------

@dataclass
class Verdict:
    status: str  # pass | fail
    line: str  # one line: the result, or the likely cause
    notes: list[str] = field(default_factory=list)


def judge(server: SpecCounters, eyas: Prediction, same_tokens: bool, reproduced: Fault | None = None) -> Verdict:
    """Compare the server's per-position accepted counts (this check's traffic) with eyas's prediction.
    pass: equal, or every position's acceptance rate within RATE_TOL of eyas's and no planted fault reproduces the
    server's counts. fail: one line naming the cause — the planted fault that reproduces the counts exactly
    (`reproduced`), else the likely one read from the signature (position 0 near zero -> the drafted tokens are
    wrong; position 0 collapsed -> the draft's input features; later positions only -> the draft's own steps)."""
    k = len(eyas.per_pos)
    srv = server.rates()
    mine = [a / eyas.rounds if eyas.rounds else 0.0 for a in eyas.per_pos]
    notes = []
    if not same_tokens:
        notes.append("the server's greedy tokens differ from eyas's on some prompt: its target numerics differ "
                     "(dtype, kernels, GPU), so the counts can only be close, not equal")
    if server.drafts <= 0:
        return Verdict("fail", "the server drafted nothing during the check: speculative decoding is off for these "
                       "requests (or the draft never ran); check --speculative-config", notes)
    counts = [int(round(v)) for v in server.per_pos]
    if counts == eyas.per_pos and int(round(server.drafts)) == eyas.rounds:
        return Verdict("pass", f"the server's accepted counts per position {counts} over {eyas.rounds} drafts equal "
                       "eyas's prediction exactly", notes)
    if reproduced is not None:
        # same numerics and a planted fault that gives the server's exact counts: stronger than any signature,
        # and it catches faults that cost little acceptance on this draft (adjacent layers look alike)
        return Verdict("fail", f"{reproduced[1]} (eyas with that fault planted reproduces the server's counts "
                       f"{counts} over {int(round(server.drafts))} drafts exactly; eyas as given: {eyas.per_pos} over "
                       f"{eyas.rounds})", notes)
    diff = [s - m for s, m in zip(srv, mine, strict=True)]
    if all(abs(d) <= RATE_TOL for d in diff):
        if same_tokens:
            notes.append("the target's tokens are identical but the accepted counts are not: the draft's numerics "
                         "differ slightly from eyas's, or a wiring fault that costs little acceptance and that none of "
                         "eyas's planted faults reproduces")
        return Verdict("pass", f"the server's acceptance per position {_fmt(srv)} is within {RATE_TOL:g} of eyas's "
                       f"{_fmt(mine)} (counts {counts} vs {eyas.per_pos})", notes)
    if not same_tokens:
        return Verdict("fail", "likely a different target: the server's greedy tokens differ from eyas's for the same "
                       "token ids, so it does not run the target eyas measured (another checkpoint, dtype or "
                       "quantization); serve the same weights, or pass that model as --target", notes)
    if srv[0] > mine[0] + RATE_TOL:
        return Verdict("fail", f"likely another draft: the server accepts more at position 0 ({srv[0]:.2f}) than eyas "
                       f"predicts ({mine[0]:.2f}) for this draft; pass the draft the server loads as --draft", notes)
    if srv[0] < NEAR_ZERO <= mine[0]:
        return Verdict("fail", f"likely the draft->target vocab map (d2t): position-0 acceptance {srv[0]:.2f} vs "
                       f"eyas's {mine[0]:.2f}, near zero: the drafted tokens are not the target's; check that the "
                       "export carries d2t (eyas export --format vllm)", notes)
    if srv[0] < COLLAPSE * mine[0]:
        return Verdict("fail", f"likely the feature wiring (aux layer ids / layer convention, or a method other than "
                       f"eagle3): position-0 acceptance {srv[0]:.2f} vs eyas's {mine[0]:.2f}; compare the export's "
                       "eagle_aux_hidden_state_layer_ids with `eyas doctor flags`", notes)
    worst = max(range(k), key=lambda i: abs(diff[i]))
    return Verdict("fail", f"likely the draft's later steps (its fed-back hidden state, RoPE or norm config): "
                   f"position 0 agrees ({srv[0]:.2f} vs {mine[0]:.2f}) but position {worst} does not "
                   f"({srv[worst]:.2f} vs {mine[worst]:.2f})", notes)


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
    server: dict[str, Any]  # this check's counter differences
    eyas: dict[str, Any]
    same_tokens: int  # prompts whose greedy tokens equal eyas's
    verdict: Verdict
    reproduced_by: str | None  # the planted fault whose prediction equals the server's counts
    seconds: dict[str, float]
    notes: list[str]

    @property
    def ok(self) -> bool:
        return self.verdict.status == "pass"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_server(url: str, target, draft_spec: str, prompts: list[list[int]], k: int | None = None,
                 max_new_tokens: int = 64, api_key: str | None = None, timeout: float = 120.0,
                 weights: str = "fp32", diagnose: bool = True, log: Callable[[str], None] | None = None
                 ) -> ServingReport:
    """The live check. `target`: the eyas Target the server serves (its tokenizer made `prompts`)."""
    from ..target.load import end_token_ids

    say = log or (lambda _m: None)
    if not prompts or not all(prompts):
        raise ServingError("no prompts to send (or an empty one): pass --prompts 1 or more")
    if max_new_tokens < 1:
        raise ServingError(f"--max-new-tokens {max_new_tokens}: expected 1 or more")
    cl = ServerClient(url, api_key, timeout)
    try:
        before = cl.counters()
        if k is not None and k != before.k:
            raise ServingError(f"--k {k}, but the server drafts {before.k} tokens per round (its "
                               f"{PER_POS} positions 0..{before.k - 1}); drop --k or pass --k {before.k}")
        k = before.k
        model = cl.model()
        stop = sorted(set(end_token_ids(target.tokenizer, target.model)))
        vocab = int(target.config.vocab_size)
        if max(max(p) for p in prompts) >= vocab:
            raise ServingError(f"a prompt holds token ids beyond the target's vocabulary ({vocab}): wrong tokenizer")
        t0 = time.perf_counter()
        got = []
        for i, ids in enumerate(prompts):
            say(f"prompt {i + 1}/{len(prompts)}: {len(ids)} tokens -> server")
            got.append(cl.complete(model, ids, max_new_tokens, stop))
        t_server = time.perf_counter() - t0
        after = cl.counters()
    finally:
        cl.close()
    delta = after.minus(before)
    notes = ["the counters are server-wide: other requests during the check add to them (this check cannot tell "
             "its own traffic apart); run it on an otherwise idle server"]
    sent_prompt, sent_new = sum(len(p) for p in prompts), sum(len(t) for t in got)
    if delta.generation_tokens is not None and delta.generation_tokens > sent_new:
        notes.append(f"other traffic was present: the server generated {delta.generation_tokens:.0f} tokens during "
                     f"the check, this check asked for {sent_new}; the comparison below is polluted")
    say(f"eyas: chain of {k} on the same {len(prompts)} prompts")
    t0 = time.perf_counter()
    mine = predict(target, draft_spec, prompts, k, max_new_tokens, stop, weights)
    t_eyas = time.perf_counter() - t0
    same = sum(a == b for a, b in zip(got, mine.tokens, strict=True))
    counts = [int(round(v)) for v in delta.per_pos]
    exact = counts == mine.per_pos and int(round(delta.drafts)) == mine.rounds
    reproduced: Fault | None = None
    seconds = {"server": t_server, "eyas": t_eyas}
    if not exact and diagnose and same == len(prompts) and delta.drafts > 0:
        # same numerics (identical greedy tokens), different counts: plant each known fault in eyas's copy of the
        # draft, the one the signature points at first (each try is a full eyas run over the prompts)
        t0 = time.perf_counter()
        vocab_first = delta.rates()[0] < NEAR_ZERO
        for fault in sorted(FAULTS, key=lambda f: (f[0] != "d2t_missing") == vocab_first):
            say(f"eyas: the same chain with a planted fault ({fault[0]})")
            alt = predict(target, draft_spec, prompts, k, max_new_tokens, stop, weights, fault[2])
            if alt.per_pos == counts and alt.rounds == int(round(delta.drafts)):
                reproduced = fault
                break
        else:
            notes.append(f"none of the faults eyas can plant ({', '.join(f[0] for f in FAULTS)}) reproduces the "
                         "server's counts exactly")
        seconds["diagnosis"] = time.perf_counter() - t0
    verdict = judge(delta, mine, same == len(prompts), reproduced)
    eyas_d = {"per_pos": mine.per_pos, "rounds": mine.rounds,
              "rates": [a / mine.rounds if mine.rounds else 0.0 for a in mine.per_pos],
              "tau": 1 + sum(mine.per_pos) / mine.rounds if mine.rounds else 0.0}
    srv_d = {**asdict(delta), "rates": delta.rates(), "tau": delta.tau(), "prompt_tokens_sent": sent_prompt,
             "new_tokens": sent_new}
    srv_d = {k_: (None if isinstance(v, float) and math.isnan(v) else v) for k_, v in srv_d.items()}
    return ServingReport(url=cl.url, model=model, k=k, prompts=len(prompts), max_new_tokens=max_new_tokens,
                         server=srv_d, eyas=eyas_d, same_tokens=same, verdict=verdict,
                         reproduced_by=reproduced[0] if reproduced else None,
                         seconds=seconds, notes=notes + verdict.notes)


def render_serving(rep: ServingReport, echo: Callable[[str], None] = print) -> None:
    s, e = rep.server, rep.eyas
    echo(f"server {rep.url} (model {rep.model}), k = {rep.k}, {rep.prompts} prompts x {rep.max_new_tokens} tokens")
    echo(f"  server: drafts {s['drafts']:.0f}, accepted per position {[int(round(v)) for v in s['per_pos']]}, "
         f"rate {_fmt(s['rates'])}, tau {s['tau']:.2f}")
    echo(f"  eyas:   drafts {e['rounds']}, accepted per position {e['per_pos']}, rate {_fmt(e['rates'])}, "
         f"tau {e['tau']:.2f}")
    echo(f"  greedy tokens equal to eyas's on {rep.same_tokens}/{rep.prompts} prompts")
    for n in rep.notes:
        echo(f"  note: {n}")
    echo(f"{rep.verdict.status.upper()}: {rep.verdict.line}")
