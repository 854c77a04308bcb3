"""The serving pieces that need no server: TextStream (partial UTF-8 held back, stop strings across chunks,
false stop prefixes released, the token limit), Metrics' Prometheus text, and `eyas serve`'s exposure warning
and flag checks."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from eyas.cli import app as cli_app
from eyas.serve.launch import exposure_warning
from eyas.serve.metrics import Metrics
from eyas.text import TextStream

# ---- text streaming (no server) -------------------------------------------------------------------

def test_text_stream_holds_partial_utf8(smollm2_tokenizer):
    tok = smollm2_tokenizer
    text = "héllo 你好 😀 naïve ☃ end"
    ids = tok.encode(text)
    ts = TextStream(tok, [], max_tokens=100)
    deltas = [ts.push([i]) for i in ids] + [ts.finish()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert any(len(tok.decode(ids[:k])) and tok.decode(ids[:k]).endswith("\ufffd") for k in range(len(ids))), \
        "the sample must contain a token boundary inside a character"


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_text_stream_stop_across_chunks(smollm2_tokenizer, chunk):
    tok = smollm2_tokenizer
    ids = tok.encode("The answer is forty-two. STOP HERE and then more text")
    stop = "STOP HERE"
    ts = TextStream(tok, ["zzz", stop], max_tokens=100)
    out = ""
    for i in range(0, len(ids), chunk):
        out += ts.push(ids[i:i + chunk])
        assert "STOP"[:2] not in out  # nothing of the stop sequence ever leaks out
        if ts.finish_reason:
            break
    assert out == "The answer is forty-two. "
    assert ts.finish_reason == "stop"
    # the token count ends at the token that completed the stop sequence
    n = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
    assert len(ts.ids) == n


def test_text_stream_releases_false_stop_prefix_and_limits(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("abc STOx def")
    ts = TextStream(tok, ["STOP"], max_tokens=100)
    out = "".join(ts.push([i]) for i in ids)
    assert ts.finish_reason is None and out + ts.finish() == "abc STOx def"
    ts = TextStream(tok, [], max_tokens=3)
    assert ts.push(ids[:2]) + ts.push(ids[2:]) == tok.decode(ids[:3]) and ts.finish_reason == "length"
    assert len(ts.ids) == 3


def test_metrics_render_prometheus():
    m = Metrics()
    m.inc("eyas_http_requests_total", endpoint="/v1/completions", status="200")
    m.observe("eyas_time_to_first_token_seconds", 0.07, endpoint="/v1/completions")

    class S:
        new_tokens, target_forwards, rounds, prefill_s, draft_s, verify_s = 9, 5, 4, 0.1, 0.2, 0.3
        accepted_per_depth, proposed_per_depth = [3, 1], [4, 3]
        lookup_proposed, lookup_accepted, ngram_proposed, ngram_accepted = 2, 1, 3, 2

    m.record_generation(S())
    text = m.render()
    assert 'eyas_http_requests_total{endpoint="/v1/completions",status="200"} 1' in text
    assert 'eyas_time_to_first_token_seconds_bucket{endpoint="/v1/completions",le="0.05"} 0' in text
    assert 'eyas_time_to_first_token_seconds_bucket{endpoint="/v1/completions",le="0.1"} 1' in text
    assert 'eyas_time_to_first_token_seconds_count{endpoint="/v1/completions"} 1' in text
    assert "eyas_spec_tau 2\n" in text  # (9 - 1) tokens / 4 rounds, as GenStats.tau
    assert 'eyas_spec_acceptance_rate{depth="1"} 0.75' in text
    assert 'eyas_spec_proposer_proposed_tokens_total{proposer="ngram"} 3' in text
    assert 'eyas_spec_proposer_accepted_tokens_total{proposer="lookup"} 1' in text
    assert "# TYPE eyas_request_latency_seconds histogram" in text


def test_exposure_warning_and_cli_flags():
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("0.0.0.0", "k") is None
    assert "without an API key" in exposure_warning("0.0.0.0", None)
    r = CliRunner().invoke(cli_app, ["serve", "--host", "0.0.0.0", "--max-new-tokens", "0"])
    assert r.exit_code == 2
    assert "without an API key" in r.output and "--max-new-tokens must be >= 1" in r.output
    r = CliRunner().invoke(cli_app, ["serve", "--draft", "none", "--method", "tree"])
    assert r.exit_code == 2 and "needs a draft" in r.output
    r = CliRunner().invoke(cli_app, ["serve", "--method", "beam"])
    assert r.exit_code == 2 and "beam" in r.output
    r = CliRunner().invoke(cli_app, ["serve", "--method", "lookup", "--lookup", "0"])
    assert r.exit_code == 2 and "give it --lookup 1 or more" in r.output
