"""A vLLM server as `eyas doctor serving` reads it: its spec-decode counters (Prometheus text) and the few
OpenAI-compatible calls the check makes.

vLLM (read in vllm/v1/spec_decode/metrics.py SpecDecodingProm, vLLM 0.32): Prometheus counters
`vllm:spec_decode_num_drafts`, `vllm:spec_decode_num_draft_tokens`, `vllm:spec_decode_num_accepted_tokens`,
and `vllm:spec_decode_num_accepted_tokens_per_pos` with a `position` label 0..k-1, created for every position
when the server starts (so k is readable before any traffic); prometheus_client writes counters with a
`_total` suffix. Labels also carry the model name and the engine index (one series per data-parallel engine:
summed here). SpecDecodingStats.observe_draft counts position i as accepted when the first i+1 drafted tokens
were accepted — eyas's GenStats.accepted_per_depth[i].

SGLang (python/sglang/srt/metrics/collector.py) exports `sglang:spec_accept_length` / `sglang:spec_accept_rate`
as gauges averaged over its last logging interval, with no per-position counter, so its /metrics cannot give one
check's counts; its responses carry per-request counts instead (eyas.doctor.sglang_counts). Which engine answers
is asked first (ServerClient.engine): SGLang serves GET /server_info (0.5.23: entrypoints/http_server.py
`server_info`, the resolved server args flat, with `version`; `/get_server_info` is its deprecated alias and
older releases' only name), vLLM GET /version (vllm/entrypoints/serve/instrumentator/basic.py `show_version`)
and /server_info only in its dev mode, as {"vllm_config": ...}.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..errors import EyasError

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"

MAX_BODY = 32 << 20  # bytes read from one GET at most


class ServingError(EyasError):
    """The server cannot be checked (unreachable, not vLLM, no spec-decode metrics); the message says why."""


class HttpStatusError(ServingError):
    """The server answered an HTTP error status (kept, so an engine probe can tell 404 from 401)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


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
        raise ServingError(f"{url}/metrics is an SGLang server's, but it did not answer GET /server_info or "
                           "/get_server_info, where eyas learns its draft shape; SGLang's /metrics holds only "
                           "averaged gauges (sglang:spec_accept_length), so point --url at SGLang itself, not a proxy")
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


# ---- which engine ---------------------------------------------------------------------------------

def _is_sglang_info(d: dict[str, Any]) -> bool:
    """SGLang's /server_info: its server args as one flat object (0.5.23 utils/common.py build_server_info ->
    ServerArgs.resolved_dict; older releases dataclasses.asdict), always with the speculative fields."""
    return "speculative_algorithm" in d and ("model_path" in d or "version" in d)


@dataclass
class EngineAnswer:
    name: str  # sglang | vllm | unknown
    version: str | None
    info: dict[str, Any] | None  # SGLang's /server_info object
    how: str  # which request told

    def line(self) -> str:
        if self.name == "unknown":
            return f"engine not identified ({self.how}); read as vLLM by its /metrics"
        return f"{'SGLang' if self.name == 'sglang' else 'vLLM'} {self.version or '(version not given)'} ({self.how})"


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
                                           "or SGLang page; point --url at the server itself")
                return body.decode("utf-8", errors="replace")
        except httpx.TimeoutException as e:
            raise ServingError(f"{self.url}{path} did not answer within --timeout {self.timeout:g} s; is the server "
                               "busy or still loading? raise --timeout") from e
        except httpx.HTTPError as e:
            raise ServingError(f"cannot reach {self.url} ({type(e).__name__}: {str(e)[:120] or 'no detail'}); is "
                               "the server running at that address and port?") from e

    def _status(self, r, path: str, body: str = "") -> None:
        c = r.status_code
        if c in (401, 403):
            raise HttpStatusError(f"{self.url}{path} answered {c} (unauthorized): pass the server's key with "
                                  "--api-key", c)
        if c == 404:
            raise HttpStatusError(f"{self.url}{path} answered 404: not an OpenAI-compatible vLLM server (vLLM "
                                  f"serves {path} by default), or --url points below its root", c)
        if c >= 400:
            raise HttpStatusError(f"{self.url}{path} answered HTTP {c}: {body[:200]!r}", c)

    def _probe_json(self, path: str) -> Any:
        """GET path as JSON, or None where the server has no such page (any error status but 401/403, or a body
        that is not JSON): a probe, so only an unreachable server or a missing key ends the check here."""
        try:
            text = self._get(path)
        except HttpStatusError as e:
            if e.status in (401, 403):
                raise
            return None
        try:
            return json.loads(text)
        except ValueError:
            return None

    def engine(self) -> EngineAnswer:
        """Which engine answers at the URL: SGLang by its /server_info (or /get_server_info), vLLM by /version."""
        for path in ("/server_info", "/get_server_info"):
            d = self._probe_json(path)
            if isinstance(d, dict) and "vllm_config" in d:
                break  # vLLM in dev mode; its version comes from /version
            if isinstance(d, dict) and _is_sglang_info(d):
                v = d.get("version")
                return EngineAnswer("sglang", str(v) if v else None, d, f"GET {path}")
        d = self._probe_json("/version")
        if isinstance(d, dict) and isinstance(d.get("version"), str):
            return EngineAnswer("vllm", d["version"], None, "GET /version")
        return EngineAnswer("unknown", None, None, "neither /server_info nor /version answered")

    def post_json(self, path: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        """POST a JSON body; the JSON object answered. what: the request in words, for the timeout message."""
        import httpx

        try:
            r = self.http.post(path, json=body)
        except httpx.TimeoutException as e:
            raise ServingError(f"{self.url}{path} did not finish {what} within --timeout {self.timeout:g} s; raise "
                               "--timeout or lower --max-new-tokens") from e
        except httpx.HTTPError as e:
            raise ServingError(f"{self.url}{path} failed ({type(e).__name__}: {str(e)[:120]}); the server may have "
                               "crashed on the request: read its log") from e
        self._status(r, path, r.text)
        try:
            out = r.json()
        except ValueError as e:
            raise ServingError(f"{self.url}{path} answered something other than JSON: {r.text[:200]!r}") from e
        if not isinstance(out, dict):
            raise ServingError(f"{self.url}{path} answered JSON that is not an object: {r.text[:200]!r}")
        return out

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
        body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
                "stop_token_ids": stop_ids, "return_token_ids": True, "skip_special_tokens": False}
        out = self.post_json("/v1/completions", body, f"a {max_tokens}-token completion")
        try:
            choice = out["choices"][0]
        except (KeyError, IndexError, TypeError) as e:
            raise ServingError(f"{self.url}/v1/completions answered without choices: {str(out)[:200]!r}") from e
        toks = choice.get("token_ids")
        if not isinstance(toks, list):
            raise ServingError(f"{self.url}/v1/completions returned no token_ids (return_token_ids): a vLLM too old "
                               "for this check (it needs the request field return_token_ids), or not vLLM")
        return [int(t) for t in toks]
