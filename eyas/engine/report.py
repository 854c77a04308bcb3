"""What `eyas generate` reads and prints around a decode: the --messages argument, the prompt's token ids, and
the summary lines after the text (tok/s, weights, tau, acceptance per depth, lookup)."""

from __future__ import annotations

import json
from pathlib import Path

from ..target.template import raw_ids
from .decode import Engine
from .params import EngineError
from .prompt import chat_input_ids, check_messages
from .stats import GenResult


def read_messages(arg: str) -> list[dict]:
    """--messages: chat JSON, or a path to a file holding it."""
    src = Path(arg)
    text = src.read_text() if len(arg) < 4096 and src.is_file() else arg
    try:
        msgs = json.loads(text)
    except json.JSONDecodeError as e:
        raise EngineError(f"--messages is not valid JSON ({e}); expected [{{\"role\": \"user\", \"content\": "
                          "\"...\"}]") from e
    check_messages(msgs)
    return msgs


def input_ids(tokenizer, prompt: str | None, messages: list[dict] | None, raw: bool) -> list[int]:
    """The chat (or --prompt as one user message) through the installed template; --prompt as is under --raw."""
    if messages is not None:
        return chat_input_ids(tokenizer, messages)
    if raw:
        return raw_ids(tokenizer, prompt)
    return chat_input_ids(tokenizer, [{"role": "user", "content": prompt}])


def summary_lines(engine: Engine, res: GenResult) -> list[str]:
    """generate's report after the text: speed, the weights that ran, and for speculative methods tau,
    acceptance per depth, the draft/verify split and what lookup contributed."""
    st, spec = res.stats, engine.spec
    lines = [f"[{spec.method}] {st.new_tokens} tokens ({res.finish_reason}) in {st.total_s:.2f}s: {st.tok_s:.1f} "
             f"tok/s ({st.decode_tok_s:.1f} after the {st.prefill_s * 1e3:.0f} ms prefill of {st.prompt_tokens} "
             "tokens)",
             f"weights: target {engine.weights}" + (f", draft {engine.draft_weights}" if engine.draft_weights else "")
             + (f" (--weights auto: {engine.weights_note})" if engine.weights_note else "")]
    if spec.method == "plain":
        return lines
    rates = " ".join(f"d{i + 1}={a:.2f}" for i, a in enumerate(st.accept_rates))
    per = max(st.rounds, 1)
    lines.append(f"tau {st.tau:.2f} tokens/forward over {st.rounds} rounds; acceptance per depth: {rates}")
    lines.append(f"per round: draft {st.draft_s / per * 1e3:.1f} ms, verify {st.verify_s / per * 1e3:.1f} ms "
                 f"(draft share {st.draft_share:.0%})")
    if spec.lookup:
        table = f"n-gram table {engine.ngram.path} ({len(engine.ngram)} contexts)" if engine.ngram else \
            "no n-gram table"
        lines.append(f"lookup: {st.lookup_accepted} of {st.lookup_proposed} proposed accepted; {table}"
                     + (f": {st.ngram_accepted} of {st.ngram_proposed} accepted" if engine.ngram else ""))
    return lines
