"""Chat messages -> prompt token ids for the engine (the chat template applied, message text kept as text)."""

from __future__ import annotations

from ..target.template import chat_ids, missing_template_message
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
