"""The one engine assembly every decoding command goes through (generate, serve, bench, bench --sweep, doctor
trace), so an option added here reaches all of them and the steps keep one order:

  check_options  everything a flag can get wrong, before anything loads: the tree shape, the draft and the
                 n-gram table asked for, the chat template, the target's family and (when required) its template;
  load_parts     the target, its chat template (before an engine reads the end-of-turn tokens), the draft, the
                 draft's template warning, the n-gram table;
  make_engine    an Engine over loaded parts; several specs can share one target and draft (bench, sweep).

load_engine runs the three for one EngineOptions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..draft import DraftCheckpoint, check_default_draft, recorded_template, resolve_draft
from ..option import (
    CHAT_TEMPLATE_HELP,
    DEFAULT_TARGET,
    DEVICE_HELP,
    DRAFT_HELP,
    DRAFT_WEIGHTS_HELP,
    DTYPE_HELP,
    METHOD_HELP,
    NGRAM_HELP,
    RAW_HELP,
    TARGET_HELP,
    WEIGHTS_HELP,
    option,
)
from ..target.family import check_engine_family
from ..target.load import Target
from ..target.open import TargetChoice
from ..target.template import ChatTemplate, draft_template_warning
from .decode import Engine
from .ngram import NgramTable, check_ngram_spec, resolve_ngram
from .params import DRAFT_METHODS, SpecParams, TreeSettings, draft_needed, resolve_method


@dataclass
class EngineOptions:
    """What a command's flags ask of the engine; unset tree settings come from TREE_DEFAULTS for the device."""

    target: str = option("--target", TARGET_HELP, DEFAULT_TARGET)
    # None: per method (eyas.engine.params.resolve_method: tree with the bundled draft, plain with --draft none)
    draft: str | None = option("--draft", DRAFT_HELP, None)
    method: str | None = option("--method", METHOD_HELP, None)
    tree: TreeSettings = field(default_factory=TreeSettings)
    ngram: str = option("--ngram", NGRAM_HELP, "auto")  # eyas.engine.ngram.resolve_ngram
    weights: str = option("--weights", WEIGHTS_HELP, "auto")
    draft_weights: str = option("--draft-weights", DRAFT_WEIGHTS_HELP, "auto")
    dtype: str = option("--dtype", DTYPE_HELP, "fp32")
    device: str = option("--device", DEVICE_HELP, "cpu")
    chat_template: str | None = option("--chat-template", CHAT_TEMPLATE_HELP, None)  # None: the tokenizer's own
    raw: bool = option("--raw", RAW_HELP, False)  # no template at all (base models)

    @property
    def draft_spec(self) -> str:
        """--draft as given, unset meaning the bundled draft (what a drafting method loads; resolve_method's rule)."""
        return self.draft or "default"

    def target_choice(self, use: EngineUse, drafted: bool = False) -> TargetChoice:
        """drafted: a draft runs, so its recorded chat template is the default (eyas.target.open)."""
        record = recorded_template(self.draft_spec) if drafted else None
        return TargetChoice(self.target, self.dtype, self.device, self.chat_template, self.raw,
                            use.template_required, record)

    def resolved(self) -> EngineOptions:
        """The method and the draft to load, decided by resolve_method (refusing the contradictions)."""
        method, draft = resolve_method(self.method, self.draft)
        return replace(self, method=method, draft=draft)

    def spec(self) -> SpecParams:
        opts = self.resolved()
        assert opts.method is not None  # resolved() decides it
        return opts.tree.spec(opts.method, opts.device, weights=opts.weights, draft_weights=opts.draft_weights)


@dataclass
class EngineUse:
    """The command building engines, as its refusals name it."""

    command: str  # what needs the engine forward, e.g. "eyas generate" (a family refusal names it)
    family_instead: str = ""  # the closest path that works for a family the engine forward does not cover
    draft_instead: str = "--draft none with --method plain"  # how to run without the bundled draft
    # False: a target without a chat template still loads (serve answers completions; chats get a 400)
    template_required: bool = True


@dataclass
class EngineParts:
    """What engines are built over: loaded once, shared by every spec of a bench or sweep."""

    target: Target
    draft: DraftCheckpoint | None
    ngram: NgramTable | None
    template_warning: str | None = None  # the draft was trained under another chat template


def needs_draft(specs: Sequence[SpecParams]) -> bool:
    return any(s.method in DRAFT_METHODS for s in specs)


def check_options(opts: EngineOptions, use: EngineUse, specs: Sequence[SpecParams] | None = None, *,
                  validate: bool = True, target_loaded: bool = False, draft_loaded: bool = False) -> ChatTemplate:
    """Refuse bad flags before anything loads; returns the chat template choice for load_parts.
    specs: the engines to be built (default: opts.spec()); none means no eyas engine (bench's HF methods
    only), so the family check is skipped. validate=False leaves each spec to the Engine (a sweep reports the
    settings it refuses); target_loaded / draft_loaded: the caller passes them in already loaded."""
    specs = [opts.spec()] if specs is None else list(specs)
    if validate:
        for s in specs:
            s.check()
    drafted = needs_draft(specs) and not draft_loaded
    draft = opts.draft_spec
    if drafted and draft == "none":
        m = next(s.method for s in specs if s.method in DRAFT_METHODS)
        raise draft_needed(m)
    if drafted:
        check_default_draft(draft, use.draft_instead)
    check_ngram_spec(opts.ngram)
    if not target_loaded and specs:
        check_engine_family(opts.target, use.command, use.family_instead)
    return opts.target_choice(use, needs_draft(specs)).template(check_files=not target_loaded)


def load_parts(opts: EngineOptions, use: EngineUse, choice: ChatTemplate, specs: Sequence[SpecParams], *,
               target: Target | None = None, draft: DraftCheckpoint | None = None,
               ngram: bool | None = None) -> EngineParts:
    """Load what `specs` need (after check_options): the target unless given, the template installed, the draft
    unless given and only for a drafting method, the n-gram table when `ngram` (None: when a spec proposes
    lookup tokens)."""
    target = opts.target_choice(use).open(target, choice)
    if draft is None and needs_draft(specs):
        draft = resolve_draft(opts.draft_spec, target)
    warning = draft_template_warning(draft.manifest, target.chat_template) if draft is not None else None
    if ngram is None:
        ngram = any(s.lookup for s in specs)
    return EngineParts(target, draft, resolve_ngram(opts.ngram, target) if ngram else None, warning)


def make_engine(parts: EngineParts, spec: SpecParams, ngram: bool = True, model=None) -> Engine:
    """The one place an Engine is built from options: the draft only for a drafting method; ngram=False runs
    lookup on the context alone (bench's lookup-context); `model` replaces the target's forward (the replay's
    recording, eyas.replay.recorded)."""
    draft = parts.draft if spec.method in DRAFT_METHODS else None
    return Engine(parts.target, draft, spec, parts.ngram if ngram else None, model=model)


def load_engine(opts: EngineOptions, use: EngineUse, *, target: Target | None = None,
                draft: DraftCheckpoint | None = None) -> tuple[Engine, EngineParts]:
    """check_options, load_parts and make_engine for opts.spec(); the parts carry the template warning."""
    opts = opts.resolved()
    spec = opts.spec()
    choice = check_options(opts, use, [spec], target_loaded=target is not None, draft_loaded=draft is not None)
    parts = load_parts(opts, use, choice, [spec], target=target, draft=draft)
    return make_engine(parts, spec), parts
