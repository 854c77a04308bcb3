"""Opening a target: the one order every command follows. The --chat-template / --raw choice is resolved and the
target's files are checked to carry a template before anything loads (a base model without one: say what to
pass); then the target loads on its device and the template is installed before anything reads its end-of-turn
tokens (eyas.target.load.end_token_ids)."""

from __future__ import annotations

from dataclasses import dataclass

from ..heartbeat import during
from .family import check_gguf_architecture, gguf_of
from .load import Target, load_target
from .template import (
    ChatTemplate,
    TemplateError,
    require_template,
    resolve_template,
    template_from_record,
    use_template,
)


@dataclass
class TargetChoice:
    """A command's --target, --dtype, --device, --chat-template and --raw. template_required=False: a target
    without a chat template still opens (serve answers completions, the doctor reports it in its checks)."""

    spec: str
    dtype: str = "fp32"
    device: str = "cpu"
    chat_template: str | None = None
    raw: bool = False
    template_required: bool = True
    # the chat-template record of the draft the command runs (its manifest): with no --chat-template or --raw,
    # chats render as the draft's data was rendered when that was a built-in or a file
    draft_record: dict | None = None

    def template(self, check_files: bool = True) -> ChatTemplate:
        """The template choice, every refusal before anything loads; check_files=False for a target passed in
        already loaded (its files may be anywhere)."""
        choice = resolve_template(self.chat_template, self.raw)
        drafted = template_from_record(self.draft_record) if self.draft_record else None
        if choice.source == "tokenizer" and drafted is not None and drafted.source in ("builtin", "file"):
            choice = drafted
        if check_files:
            gguf = gguf_of(self.spec)
            if gguf is not None:  # a GGUF eyas cannot convert: said first, not a template it may also lack
                check_gguf_architecture(gguf)
        if check_files and self.template_required:
            require_template(self.spec, choice)
        return choice

    def open(self, target: Target | None = None, choice: ChatTemplate | None = None,
             load_weights: bool = True) -> Target:
        """The target (loaded unless given) with the template installed. choice: from an earlier `template()`
        (a command that checks everything before loading anything); load_weights=False: the model on the meta
        device, for a target that runs elsewhere (vLLM)."""
        if choice is None:
            choice = self.template(check_files=target is None)
        if target is None:
            with during(f"loading the target {self.spec}" + ("" if load_weights else " (its config only)")):
                target = load_target(self.spec, dtype=self.dtype, device=self.device, load_weights=load_weights)
        try:
            use_template(target, choice)
        except TemplateError:
            if self.template_required:
                raise
        return target
