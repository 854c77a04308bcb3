"""What a bench run loads, checked first: its engine options and each eyas method's spec, the chat template (or
--raw), the target, draft and n-gram table, and the prompts' token ids."""

from __future__ import annotations

from dataclasses import replace

from ..draft import DraftCheckpoint
from ..engine.load import EngineOptions, EngineParts, EngineUse, check_options, load_parts
from ..engine.params import DRAFT_METHODS, SpecParams
from ..target.load import Target
from ..target.template import ChatTemplate, raw_ids, resolve_template
from .config import BenchConfig, BenchError
from .prompts import BenchPrompt


def bench_options(cfg: BenchConfig) -> EngineOptions:
    """The engine options of a bench run."""
    return EngineOptions(target=cfg.target, draft=cfg.draft, tree=cfg.tree, ngram=cfg.ngram, weights=cfg.weights,
                         draft_weights=cfg.draft_weights, dtype=cfg.dtype, device=cfg.device,
                         chat_template=cfg.chat_template, raw=cfg.raw)


def bench_spec(cfg: BenchConfig, m: str) -> SpecParams:
    """An eyas method's engine spec, the device's defaults where the run gave none (as generate and serve):
    tree-lookup is the tree with --lookup candidates merged in, tree and chain merge none, lookup and
    lookup-context run the lookup chain alone (--lookup tokens, default LOOKUP_ALONE)."""
    method = {"tree-lookup": "tree", "lookup-context": "lookup"}.get(m, m)
    lookup = cfg.tree.lookup if m == "tree-lookup" or method == "lookup" else 0
    tree = replace(cfg.tree, lookup=lookup, min_prob=cfg.tree.min_prob if method in DRAFT_METHODS else 0.0)
    return tree.spec(method, cfg.device, weights=cfg.weights, draft_weights=cfg.draft_weights)


def bench_template(cfg: BenchConfig, prompts: list[BenchPrompt] | None) -> ChatTemplate:
    """--chat-template / --raw, checked before anything loads: raw sends single-turn prompts only."""
    choice = resolve_template(cfg.chat_template, cfg.raw)
    if choice.raw:
        if cfg.turn != 1:
            raise BenchError("--raw sends one plain-text prompt, but MT-bench --turn 2 is a chat (it holds the first "
                             "answer): use --turn 1, or drop --raw and pass --chat-template NAME")
        multi = [p.id for p in prompts or [] if len(p.messages) != 1]
        if multi:
            raise BenchError(f"--raw sends each prompt's text as is, but prompts {multi[:3]} are multi-message chats; "
                             "give single-turn rows ({\"prompt\": ...}), or drop --raw and pass --chat-template NAME")
    return choice


def bench_parts(cfg: BenchConfig, prompts: list[BenchPrompt] | None, specs: list[SpecParams], use: EngineUse,
                target: Target | None, draft: DraftCheckpoint | None, *, validate: bool = True,
                ngram: bool | None = None) -> EngineParts:
    """Every engine option checked before anything loads (eyas.engine.load), then the target unless given (with
    the template installed), the draft unless given, and the n-gram table; the template warning is said."""
    bench_template(cfg, prompts)  # --raw's refusals
    opts = bench_options(cfg)
    choice = check_options(opts, use, specs, validate=validate, target_loaded=target is not None,
                           draft_loaded=draft is not None)  # the draft's recorded template unless one is given
    return load_parts(opts, use, choice, specs, target=target, draft=draft, ngram=ngram)


def prompt_ids(target: Target, prompts: list[BenchPrompt]) -> list[list[int]]:
    """Each prompt's token ids: through the installed chat template, or as plain text under --raw."""
    from ..engine.prompt import chat_input_ids

    if target.chat_template is not None and target.chat_template.raw:
        return [raw_ids(target.tokenizer, p.messages[0]["content"]) for p in prompts]
    return [list(chat_input_ids(target.tokenizer, p.messages)) for p in prompts]

