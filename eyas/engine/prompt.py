"""What a command decodes -> prompt token ids for the engine: chat messages through the chat template (message text
kept as text), --messages JSON read and checked, --prompt as one user message or, under --raw, as plain text."""

from __future__ import annotations

import json
from pathlib import Path

from ..target.template import chat_ids, missing_template_message, raw_ids
from .params import EngineError


def check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise EngineError('messages must be a non-empty list of {"role": "...", "content": "..."} objects (strings); '
                          f"found {str(messages)[:120]}")


def chat_input_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Chat template with the generation prompt -> token ids (eyas.target.template.chat_ids: message text is text, a
    control-token string inside a message is never the control token; the template's own stay exact)."""
    check_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise EngineError(missing_template_message("this target's tokenizer"))
    return chat_ids(tokenizer, messages)


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
        assert prompt is not None  # the commands take exactly one of --prompt and --messages
        return raw_ids(tokenizer, prompt)
    return chat_input_ids(tokenizer, [{"role": "user", "content": prompt}])
