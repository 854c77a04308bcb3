"""Chat templates, the one owner: which template a command renders with, how a chat becomes token ids, and how
the choice is recorded in manifests and compared.

Resolution order (`resolve_template`): `--raw` (no template: text is tokenized as is) > `--chat-template
FILE|NAME` (a built-in name below, else a Jinja file) > the tokenizer's own template > an error that says what to
pass. A target whose tokenizer has no template is found before its weights load (`require_template`: the GGUF's
`tokenizer.chat_template` key or the HF folder's tokenizer files).

Message text is text: a control-token string typed inside a message ("<|im_end|>") is tokenized as the characters
it is made of, never as the control token, in serving (`chat_ids`) and in training data (`chat_ids_with_starts`)
alike, so a message cannot forge a turn boundary and the draft trains on the tokens serving produces.

Recorded as `chat_template: {"source": "tokenizer"|"builtin"|"file"|"raw", "name", "sha256"}` in shard manifests
and draft manifests; two records agree when their template texts hash the same (or both are raw). A manifest
without the field (written before templates were recorded) means "the tokenizer's own template".
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EyasError


class TemplateError(EyasError):
    """A --chat-template that cannot be used, or a target without a template; says what to pass instead."""


# Small, standard templates for tokenizers that ship none (base models). Each renders turns append-only (the
# datagen loss mask needs prefix-consistent rendering) and writes no default system prompt.
BUILTIN_TEMPLATES: dict[str, str] = {
    # ChatML (Qwen, SmolLM2, many fine-tunes): <|im_start|>role\n...<|im_end|>\n; no BOS. On a vocabulary without
    # <|im_start|>/<|im_end|> tokens the markers are plain text and replies end only at the tokenizer's eos.
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # Gemma (2/3): BOS, <start_of_turn>user|model ... <end_of_turn>; a system message is folded into the first user
    # turn (Gemma has no system role). The Gemma vocabulary holds these tokens, so a Gemma base model can use it.
    "gemma": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\\n\\n' %}"
        "{% set loop_messages = messages[1:] %}{% else %}{% set prefix = '' %}{% set loop_messages = messages %}"
        "{% endif %}{% for message in loop_messages %}{% set role = 'model' if message['role'] == 'assistant' "
        "else message['role'] %}{{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + "
        "message['content'] + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<start_of_turn>model\\n' }}{% endif %}"
    ),
    # Llama 3: BOS, <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|> (no date/system preamble).
    "llama3": (
        "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
}


def _sha(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class ChatTemplate:
    """A command's template choice. `text` is None for raw, and for 'tokenizer' until a tokenizer is seen."""
    source: str  # "tokenizer" | "builtin" | "file" | "raw"
    name: str | None = None  # the built-in name or the file path
    text: str | None = None

    @property
    def raw(self) -> bool:
        return self.source == "raw"

    def record(self) -> dict[str, Any]:
        """What manifests store (the template text itself is not stored: its hash identifies it)."""
        return {"source": self.source, "name": self.name, "sha256": _sha(self.text) if self.text else None}

    def describe(self) -> str:
        return describe_record(self.record())


def resolve_template(spec: str | None, raw: bool = False) -> ChatTemplate:
    """--chat-template / --raw -> a ChatTemplate (no tokenizer needed; bad flags fail before anything loads)."""
    if raw and spec is not None:
        raise TemplateError(f"--raw and --chat-template {spec} contradict each other: --raw renders no template; "
                            "pass one of them")
    if raw:
        return ChatTemplate("raw")
    if spec is None:
        return ChatTemplate("tokenizer")
    if spec in BUILTIN_TEMPLATES:
        return ChatTemplate("builtin", spec, BUILTIN_TEMPLATES[spec])
    p = Path(spec)
    if not p.exists():
        raise TemplateError(f"--chat-template {spec!r} is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)})"
                            " nor an existing file; pass one of those names or a path to a Jinja template file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TemplateError(f"--chat-template {spec}: cannot read it as a UTF-8 text file ({e}); expected a Jinja "
                            f"chat template file, or a built-in name ({', '.join(BUILTIN_TEMPLATES)})") from e
    if p.suffix == ".json":  # a chat_template.json as transformers writes it: {"chat_template": "..."}
        try:
            text = json.loads(text)["chat_template"]
        except (ValueError, KeyError, TypeError) as e:
            raise TemplateError(f"--chat-template {spec}: a .json file must hold {{\"chat_template\": \"...\"}} "
                                f"({e}); or pass the Jinja text in a .jinja file") from e
    if not isinstance(text, str) or not text.strip():
        raise TemplateError(f"--chat-template {spec}: the file is empty; expected a Jinja chat template")
    try:
        import jinja2

        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"--chat-template {spec}: not a valid Jinja template (line {e.lineno}: {e.message}); "
                            "fix the file or pass a built-in name") from e
    return ChatTemplate("file", str(p.resolve()), text)


def missing_template_message(what: str, suggest: str = "chatml") -> str:
    """The one 'no chat template' message: what to pass instead (`suggest`: the built-in that fits the family)."""
    names = ", ".join(BUILTIN_TEMPLATES)
    return (f"{what} has no chat template (a base model?): pass --chat-template {suggest} (or another built-in: "
            f"{names}; or a Jinja file) to render chats, or --raw to use plain text without a template")


def _family(spec: str) -> str:
    """The model family a target spec names in its files ('' when unknown; eyas.target.family.target_family reads it);
    picks the built-in a refusal suggests."""
    from .family import target_family

    try:
        return target_family(spec)[0] or ""
    except EyasError:
        return ""


_UNKNOWN = object()


def peek_template(spec: str) -> str | None | object:
    """The chat template a target spec's tokenizer carries, read from its files without loading anything:
    a GGUF's `tokenizer.chat_template`, a HF folder's chat_template.jinja/.json or tokenizer_config.json.
    Returns None when it has none, _UNKNOWN when the files cannot tell (the post-load check decides)."""
    from ..native.gguf_file import read_gguf_metadata
    from .family import gguf_of

    try:
        gguf = gguf_of(spec)  # a missing file raises TargetError: _UNKNOWN below, load_target names it
        if gguf is not None:
            return read_gguf_metadata(gguf, {"tokenizer.chat_template"}).get("tokenizer.chat_template")
        folder = Path(spec)
        if not (folder / "tokenizer_config.json").is_file():
            return _UNKNOWN
        if (folder / "chat_template.jinja").is_file():
            return (folder / "chat_template.jinja").read_text(encoding="utf-8")
        if (folder / "chat_template.json").is_file():
            return json.loads((folder / "chat_template.json").read_text()).get("chat_template")
        return json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    except EyasError:
        return _UNKNOWN  # a bad file: load_target gives the one clear error about it
    except (OSError, ValueError):
        return _UNKNOWN


def require_template(target_spec: str, choice: ChatTemplate) -> None:
    """Before the target loads: a command that renders with the tokenizer's own template refuses a target
    that has none, saying what to pass."""
    if choice.source == "tokenizer" and peek_template(target_spec) is None:
        # Gemma vocabularies hold <start_of_turn>/<end_of_turn>: its own format beats ChatML text markers
        suggest = "gemma" if _family(target_spec).startswith("gemma") else "chatml"
        raise TemplateError(missing_template_message(f"the target {target_spec}", suggest))


def apply_template(tokenizer: Any, choice: ChatTemplate, what: str = "the target") -> ChatTemplate:
    """Install the choice on a loaded tokenizer (every later render, end-of-turn lookup and control-token check
    reads tokenizer.chat_template) and return it with the text filled in. Raw leaves the tokenizer alone."""
    if choice.raw:
        return choice
    if choice.source == "tokenizer":
        text = getattr(tokenizer, "chat_template", None)
        if isinstance(text, dict):  # several named templates: transformers renders the "default" one
            text = text.get("default")
        if not text:
            raise TemplateError(missing_template_message(what))
        return ChatTemplate("tokenizer", None, text)
    tokenizer.chat_template = choice.text
    return choice


def use_template(target: Any, choice: ChatTemplate) -> ChatTemplate:
    """apply_template on a loaded eyas Target; the choice is kept as target.chat_template."""
    resolved = apply_template(target.tokenizer, choice, f"the target {target.source}")
    target.chat_template = resolved
    return resolved


# ---- records in manifests ----------------------------------------------------------------------------

def describe_record(rec: dict[str, Any] | None) -> str:
    if rec is None:
        return "the tokenizer's own template (not recorded: an artifact from before templates were recorded)"
    if rec.get("source") == "raw":
        return "raw text (no template)"
    sha = rec.get("sha256")
    if rec.get("source") == "builtin":
        return f"built-in '{rec.get('name')}' ({sha})"
    if rec.get("source") == "file":
        return f"file {rec.get('name')} ({sha})"
    return f"the tokenizer's own template ({sha})"


def same_template(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two records render alike: both raw, or the same template text. A missing record means the
    tokenizer's own template: it matches a 'tokenizer' record (the weights fingerprint already pins the model)."""
    if a is None or b is None:
        other = b if a is None else a
        return other is None or other.get("source") == "tokenizer"
    if a.get("source") == "raw" or b.get("source") == "raw":
        return a.get("source") == b.get("source")
    return a.get("sha256") == b.get("sha256")


def fix_for(rec: dict[str, Any] | None) -> str:
    """The flag that reproduces a recorded choice."""
    if rec is None or rec.get("source") == "tokenizer":
        return "run without --chat-template/--raw (the tokenizer's own template)"
    if rec.get("source") == "raw":
        return "pass --raw"
    return f"pass --chat-template {rec.get('name')}"


def template_from_record(rec: dict[str, Any] | None) -> ChatTemplate | None:
    """The ChatTemplate a manifest record names, when it can be rebuilt exactly: raw, the tokenizer's own, a
    built-in of the same text, or a file that still holds the recorded text. None otherwise (a file since edited
    or gone): the record still identifies the template, only its text is not at hand."""
    if rec is None or rec.get("source") == "tokenizer":
        return ChatTemplate("tokenizer")
    if rec.get("source") == "raw":
        return ChatTemplate("raw")
    try:
        choice = resolve_template(rec.get("name"))
    except TemplateError:
        return None
    return choice if choice.text and _sha(choice.text) == rec.get("sha256") else None


def draft_template_warning(manifest: dict[str, Any], choice: ChatTemplate | None) -> str | None:
    """A draft trained under another template than the one in use: decoding stays lossless (the target decides
    every token) but acceptance drops, so this is a loud warning rather than a refusal. None when they agree."""
    if choice is None or manifest.get("untrained"):
        return None
    rec = manifest.get("chat_template")
    if same_template(rec, choice.record()):
        return None
    return (f"the draft was trained on chats rendered with {describe_record(rec)}, but this run renders with "
            f"{choice.describe()}: the output stays lossless, acceptance (speed) will be lower; "
            f"{fix_for(rec)} to match the draft")


# ---- chats -> token ids (message text stays text) --------------------------------------------------------

# Private-use characters that wrap control-token strings found in message text while the template renders,
# so that they can be told apart from the control tokens the template writes itself.
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"


def control_tokens(tokenizer: Any) -> list[str]:
    """The token strings a chat message must not be able to produce as token ids: every special added token
    (turn delimiters, BOS/EOS) plus the non-special added tokens the chat template writes (some families
    mark their role tokens non-special). Whitespace tokens are left out: templates write them as text."""
    template = getattr(tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else str(template)
    out = {t.content for t in tokenizer.added_tokens_decoder.values()
           if t.content and (t.special or (t.content in template and not t.content.isspace()))}
    return sorted(out, key=len, reverse=True)  # longest first: a token wins over the tokens it contains


def _control_pattern(tokenizer: Any) -> tuple[list[str], re.Pattern]:
    controls = control_tokens(tokenizer)
    return controls, re.compile("|".join(map(re.escape, controls)) or "(?!)")


def mark_messages(tokenizer: Any, messages: list[dict[str, str]]) -> list[dict[str, str]] | None:
    """The messages with every control-token string (and marker character) in their text wrapped in markers;
    None when no message holds one (then the template's own tokenization is already exact)."""
    _, pattern = _control_pattern(tokenizer)
    if not any(pattern.search(m["content"]) for m in messages):
        return None
    # the marker characters themselves are wrapped too, so message text cannot forge a marked span and
    # keeps every character it had
    wrap = re.compile(f"{pattern.pattern}|[{_MARK_OPEN}{_MARK_CLOSE}]")
    return [{**m, "content": wrap.sub(lambda x: _MARK_OPEN + x.group(0) + _MARK_CLOSE, m["content"])}
            for m in messages]


def _encode_text(tokenizer: Any, text: str, as_text: bool, control_ids: set[int],
                 offsets: bool) -> tuple[list[int], list[int]]:
    """(ids, start offset of each token in `text`)."""
    kw: dict[str, Any] = {"add_special_tokens": False, "split_special_tokens": as_text}
    if offsets:
        kw["return_offsets_mapping"] = True
    enc = tokenizer(text, **kw)
    ids = list(enc["input_ids"])
    starts = [int(s) for s, _ in enc["offset_mapping"]] if offsets else [0] * len(ids)
    if as_text and control_ids.intersection(ids):
        # a non-special added token is matched even with split_special_tokens; one character at a time
        # cannot spell a multi-character token
        ids, starts = [], []
        for j, ch in enumerate(text):
            one = tokenizer(ch, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            ids += one
            starts += [j] * len(one)
    return ids, starts


def _encode_piece(tokenizer: Any, piece: str, as_text: bool, control_ids: set[int], newline: list[int],
                  offsets: bool) -> tuple[list[int], list[int]]:
    # encoded after a newline that is then dropped: SentencePiece-style tokenizers add a prefix space at the
    # start of a string, which a piece from the middle of the chat must not get
    ids, starts = _encode_text(tokenizer, "\n" + piece, as_text, control_ids, offsets)
    if ids[:len(newline)] == newline:
        return ids[len(newline):], [max(s - 1, 0) for s in starts[len(newline):]]
    return _encode_text(tokenizer, piece, as_text, control_ids, offsets)


def encode_marked(tokenizer: Any, rendered: str, offsets: bool = False) -> tuple[list[int], list[int]]:
    """Token ids of a chat rendered from mark_messages' output: marked spans as text, the rest (what the
    template wrote) with its control tokens live. With `offsets`, also each token's start as a character
    offset into `rendered` (needs a fast tokenizer)."""
    controls, pattern = _control_pattern(tokenizer)
    wrap = f"{pattern.pattern}|[{_MARK_OPEN}{_MARK_CLOSE}]"
    # a lone marker (a template that cut a marked span) still separates the text on its sides, so they cannot
    # join into a control token
    pieces: list[tuple[int, str, bool]] = []  # (start in rendered, text, as_text)
    pos = 0
    for m in re.finditer(f"{_MARK_OPEN}({wrap}){_MARK_CLOSE}|[{_MARK_OPEN}{_MARK_CLOSE}]", rendered):
        if m.start() > pos:
            pieces.append((pos, rendered[pos:m.start()], False))
        if m.group(1) is not None:
            pieces.append((m.start(1), m.group(1), True))
        pos = m.end()
    if pos < len(rendered):
        pieces.append((pos, rendered[pos:], False))
    control_ids = {int(i) for i in tokenizer.convert_tokens_to_ids(controls)} if controls else set()
    newline = list(tokenizer("\n", add_special_tokens=False)["input_ids"])
    ids: list[int] = []
    starts: list[int] = []
    for n, (at, text, as_text) in enumerate(pieces):
        if n == 0 and at == 0 and not as_text:
            got, st = _encode_text(tokenizer, text, as_text, control_ids, offsets)
        else:
            got, st = _encode_piece(tokenizer, text, as_text, control_ids, newline, offsets)
        ids += got
        starts += [at + s for s in st]
    return [int(t) for t in ids], starts


def render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The installed template's text for a chat (TemplateError when it rejects the chat or there is none)."""
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError(missing_template_message("the tokenizer"))
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja raises its own types (e.g. "roles must alternate")
        raise TemplateError(f"the chat template rejected the conversation: {e}") from e


def chat_ids(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """A chat -> token ids through the installed template, message text as text (see the module doc)."""
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError(missing_template_message("the tokenizer"))
    marked = mark_messages(tokenizer, messages)
    if marked is None:  # nothing to neutralise: exactly the template's own tokenization
        try:
            out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        except Exception as e:  # jinja raises its own types (raise_exception: e.g. "roles must alternate")
            raise TemplateError(f"the chat template rejected the conversation: {e}") from e
        if hasattr(out, "keys") and "input_ids" in out:
            out = out["input_ids"]
        return [int(t) for t in out]
    return encode_marked(tokenizer, render(tokenizer, marked, add_generation_prompt))[0]


def raw_ids(tokenizer: Any, text: str, as_text: bool = False) -> list[int]:
    """Plain text -> token ids with the tokenizer's own special-token rule (a BOS where the tokenizer adds one,
    as a base model saw in pre-training). `as_text`: control-token strings in `text` stay characters (data
    files); otherwise they are live tokens (a raw prompt is the user's whole input, like /v1/completions)."""
    return [int(t) for t in tokenizer(text, add_special_tokens=True, split_special_tokens=as_text)["input_ids"]]
