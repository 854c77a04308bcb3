"""The replay predictor: a draft's greedy speculative decoding on recorded rows, with the draft alone.

Each row runs through eyas's engine (eyas.engine.load.make_engine) with the target replaced by its recording
(eyas.replay.recorded.RecordedModel): the same drafting, lookup merge, verification, commit and counters as a
live `eyas generate`, so the counts are the engine's, and with them vLLM's spec-decode counters (a round is one
of vLLM's drafts; accepted_per_depth[i] is its num_accepted_tokens_per_pos[i]: rounds whose first i+1 drafted
tokens were accepted, a reply's last round included even where it runs past max_tokens or an end token).

Serving configurations: a vLLM chain of k (`num_speculative_tokens`), an eyas tree (depth / topk / tokens), or
SGLang's flags (steps / topk / num_draft_tokens, which counts the root like eyas's tokens; topk 1 is a chain of
steps, as SGLang forces num_draft_tokens = steps + 1 there).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..draft import DraftCheckpoint, load_draft
from ..engine.params import SamplingParams, SpecParams, TreeSettings
from ..target.family import text_config
from ..target.load import Target, input_embeddings
from .recorded import RecordedModel
from .rows import ReplayError, ReplayRows


@dataclass
class RowReplay:
    per_pos: list[int]  # accepted per draft depth (vLLM: num_accepted_tokens_per_pos)
    proposed: list[int]  # rounds that attempted each depth
    rounds: int  # speculative rounds after the prefill (vLLM: num_drafts)
    new_tokens: int


@dataclass
class ReplayResult:
    spec: dict[str, Any]
    max_new_tokens: int
    per_pos: list[int]
    proposed: list[int]
    rounds: int
    new_tokens: int
    rows: list[RowReplay] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """vLLM's mean acceptance length: 1 + accepted drafted tokens per draft (what its log and metrics give)."""
        return 1.0 + sum(self.per_pos) / self.rounds if self.rounds else 0.0

    @property
    def tau_committed(self) -> float:
        """eyas's τ: committed tokens per round after the prefill's token (GenStats.tau over all rows)."""
        return (self.new_tokens - len(self.rows)) / self.rounds if self.rounds else 0.0

    @property
    def rates(self) -> list[float]:
        return [a / self.rounds if self.rounds else 0.0 for a in self.per_pos]

    def counts(self) -> tuple[list[int], int]:
        return list(self.per_pos), self.rounds

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tau": self.tau, "tau_committed": self.tau_committed, "rates": self.rates}


def chain(k: int) -> SpecParams:
    """vLLM's EAGLE-3 proposal: a chain of k drafted tokens per round (num_speculative_tokens)."""
    return TreeSettings(steps=k, lookup=0, min_prob=0.0).spec("chain", None, weights="fp32", draft_weights="fp32")


def tree(depth: int, topk: int, tokens: int, lookup: int = 0, min_prob: float = 0.0) -> SpecParams:
    """eyas's EAGLE-2 dynamic tree (tokens counts the root); topk 1 is a chain of depth."""
    knobs = TreeSettings(steps=depth, depth=depth, topk=topk, tokens=tokens, lookup=lookup, min_prob=min_prob)
    return knobs.spec("chain" if topk == 1 else "tree", None, weights="fp32", draft_weights="fp32")


def sglang(steps: int, topk: int, num_draft_tokens: int) -> SpecParams:
    """SGLang's --speculative-num-steps / --speculative-eagle-topk / --speculative-num-draft-tokens as the tree
    eyas replays (with topk 1 SGLang drafts steps + 1 tokens whatever num_draft_tokens says)."""
    return tree(steps, topk, steps + 1 if topk == 1 else num_draft_tokens)


def replay(rows: ReplayRows, target: Target, draft: str | DraftCheckpoint, spec: SpecParams,
           max_new_tokens: int | None = None, plant=None, device: str | torch.device = "cpu",
           limit: int | None = None) -> ReplayResult:
    """Replay `spec` with `draft` on `rows` (captured from `target`, which may be loaded without weights).
    plant(ck, num_layers) changes a copy of the draft first (a wiring fault, eyas.replay.plants)."""
    m = rows.max_new_tokens if max_new_tokens is None else max_new_tokens
    if not 1 <= m <= rows.max_new_tokens:
        raise ReplayError(f"--max-new-tokens {m}: the rows{'' if rows.path is None else f' ({rows.path})'} were "
                          f"captured for at most {rows.max_new_tokens}; capture them again for longer replies")
    rows.check_target(target.identity)
    ck = load_draft(draft, device="cpu") if isinstance(draft, str) else copy.deepcopy(draft)
    if plant is not None:
        plant(ck, target.num_layers)
    rows.check_streams(list(ck.layout.aux_indices), f"a draft on stream indices {ck.layout.aux_indices}")
    from ..engine.load import EngineParts, make_engine

    cfg = text_config(target.config)
    model = RecordedModel(rows, cfg, input_embeddings(target), device)
    eng = make_engine(EngineParts(target, ck, None), copy.deepcopy(spec), model=model)
    eng.eos = set(rows.eos)
    n = len(rows) if limit is None else min(limit, len(rows))
    out: list[RowReplay] = []
    for i in range(n):
        model.use(i)
        cap = m if rows.caps is None else min(m, rows.caps[i])
        res = eng.generate(rows.prompt(i), SamplingParams(temperature=0.0, max_new_tokens=cap))
        want = rows.reply(i, cap)
        if res.token_ids != want:  # lossless by construction: a difference is a bug in the replay, never noise
            raise ReplayError(f"row {i}: the replay committed {len(res.token_ids)} tokens that differ from the "
                              f"recorded reply ({len(want)} tokens) — a bug in eyas's replay; please report it")
        st = res.stats
        out.append(RowReplay(per_pos=list(st.accepted_per_depth), proposed=list(st.proposed_per_depth),
                             rounds=st.rounds, new_tokens=st.new_tokens))
    width = max((len(r.per_pos) for r in out), default=0)
    per = [sum(r.per_pos[d] for r in out if d < len(r.per_pos)) for d in range(width)]
    prop = [sum(r.proposed[d] for r in out if d < len(r.proposed)) for d in range(width)]
    return ReplayResult(spec=asdict(spec), max_new_tokens=m, per_pos=per, proposed=prop,
                        rounds=sum(r.rounds for r in out), new_tokens=sum(r.new_tokens for r in out), rows=out)
