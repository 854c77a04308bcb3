"""What one generation returns: the text and ids, and the counters every report reads (tau, acceptance per depth,
tok/s, the draft/verify split, lookup and n-gram shares)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0  # all target forwards, prefill included
    rounds: int = 0  # target forwards after prefill (one per decode step / speculative round)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    # accepted_per_depth[d-1]: rounds whose accepted path reached depth d; proposed_per_depth[d-1]: rounds
    # whose path reached depth d-1 and the tree had candidates below it (so depth d was attempted)
    accepted_per_depth: list[int] = field(default_factory=list)
    proposed_per_depth: list[int] = field(default_factory=list)
    lookup_proposed: int = 0  # tree nodes only context lookup proposed (not also a draft candidate)
    lookup_accepted: int = 0  # accepted tokens that came from those nodes
    ngram_proposed: int = 0  # the same for the n-gram table's nodes (rounds where context lookup had nothing)
    ngram_accepted: int = 0
    draft_forwards: int = 0  # draft-layer calls (step 0 and each tree depth): a count, unlike draft_s, tests can trust

    @property
    def tau(self) -> float:
        """Tokens per target forward after prefill, bonus included. The prefill's own token is not
        counted, so plain decoding measures exactly 1.0; 0.0 when there was no round."""
        return (self.new_tokens - 1) / self.rounds if self.rounds else 0.0

    @property
    def tok_s(self) -> float:
        """new tokens / total time (prefill included)."""
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        dt = self.total_s - self.prefill_s
        return (self.new_tokens - 1) / dt if dt > 0 and self.new_tokens > 1 else 0.0

    @property
    def accept_rates(self) -> list[float]:
        """Conditional acceptance per depth: P(depth d accepted | depth d-1 accepted and d attempted)."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_per_depth, self.proposed_per_depth, strict=True)]

    @property
    def draft_share(self) -> float:
        """Drafting time / (drafting + verification) time over the rounds."""
        t = self.draft_s + self.verify_s
        return self.draft_s / t if t > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tau=self.tau, tok_s=self.tok_s, decode_tok_s=self.decode_tok_s, accept_rates=self.accept_rates,
                 draft_share=self.draft_share)
        return d


@dataclass
class GenResult:
    token_ids: list[int]  # new tokens; an EOS that ended the generation is included
    text: str  # decoded without special tokens; a matched stop string and what follows are cut
    finish_reason: str  # "stop" (EOS or stop string) | "length"
    stats: GenStats
