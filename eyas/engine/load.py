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
from dataclasses import dataclass

from ..draft import DraftCheckpoint, check_default_draft, resolve_draft
from ..target.family import check_engine_family
from ..target.load import Target, load_target
from ..target.template import (
    ChatTemplate,
    TemplateError,
    draft_template_warning,
    require_template,
    resolve_template,
    use_template,
)
from .decode import Engine
from .ngram import NgramTable, check_ngram_spec, resolve_ngram
from .params import DRAFT_METHODS, EngineError, SpecParams, tree_defaults


@dataclass
class EngineOptions:
    """What a command's flags ask of the engine; None tree settings come from TREE_DEFAULTS for the device."""

    target: str = "smollm2-135m"
    draft: str = "default"  # a draft folder, 'default' (bundled), 'random' (untrained) or 'none'
    method: str | None = None  # None: tree with a draft, plain with --draft none
    steps: int | None = None  # chain: draft steps per round; None: SpecParams' default
    depth: int | None = None
    topk: int | None = None
    tokens: int | None = None
    lookup: int | None = None
    min_prob: float | None = None
    ngram: str = "auto"  # eyas.engine.ngram.resolve_ngram
    weights: str = "auto"
    draft_weights: str = "auto"
    dtype: str = "fp32"
    device: str = "cpu"
    chat_template: str | None = None  # --chat-template FILE|NAME; None: the tokenizer's own
    raw: bool = False  # no template at all (base models)

    def resolved_method(self) -> str:
        if self.method is not None:
            return self.method
        return "plain" if self.draft == "none" else "tree"

    def spec(self) -> SpecParams:
        method = self.resolved_method()
        tree = tree_defaults(self.device, method, depth=self.depth, topk=self.topk, tokens=self.tokens,
                             lookup=self.lookup, min_prob=self.min_prob)
        steps = SpecParams.steps if self.steps is None else self.steps
        return SpecParams(method=method, steps=steps, weights=self.weights, draft_weights=self.draft_weights, **tree)


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
    if drafted and opts.draft == "none":
        m = next(s.method for s in specs if s.method in DRAFT_METHODS)
        raise EngineError(f"--method {m} needs a draft: pass --draft PATH, 'default' or 'random', or use "
                          "--method plain")
    if drafted:
        check_default_draft(opts.draft, use.draft_instead)
    check_ngram_spec(opts.ngram)
    choice = resolve_template(opts.chat_template, opts.raw)
    if not target_loaded:
        if specs:
            check_engine_family(opts.target, use.command, use.family_instead)
        if use.template_required:
            require_template(opts.target, choice)  # a base model without a template: say what to pass
    return choice


def load_parts(opts: EngineOptions, use: EngineUse, choice: ChatTemplate, specs: Sequence[SpecParams], *,
               target: Target | None = None, draft: DraftCheckpoint | None = None,
               ngram: bool | None = None) -> EngineParts:
    """Load what `specs` need (after check_options): the target unless given, the template installed, the draft
    unless given and only for a drafting method, the n-gram table when `ngram` (None: when a spec proposes
    lookup tokens)."""
    if target is None:
        target = load_target(opts.target, dtype=opts.dtype, device=opts.device)
    try:
        use_template(target, choice)  # before an engine reads the end-of-turn tokens
    except TemplateError:
        if use.template_required:
            raise
    if draft is None and needs_draft(specs):
        draft = resolve_draft(opts.draft, target)
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
    spec = opts.spec()
    choice = check_options(opts, use, [spec], target_loaded=target is not None, draft_loaded=draft is not None)
    parts = load_parts(opts, use, choice, [spec], target=target, draft=draft)
    return make_engine(parts, spec), parts
