"""What a decode is asked for: sampling parameters, the speculative method and its tree shape, and
the per-device tree defaults (stated once here; help strings, the Makefile and the README read them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import EyasError
from ..option import option

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # torch generators take a 64-bit seed
WEIGHTS = ("auto", "native", "native-bf16", "fp32")  # the target forward (eyas.engine.weights)
DRAFT_WEIGHTS = ("auto", "q8", "fp32")


METHODS = ("tree", "chain", "lookup", "plain")


DRAFT_METHODS = ("tree", "chain")  # the methods an EAGLE-3 draft proposes for (lookup and plain load none)


MIN_TEMPERATURE = 1e-6


class EngineError(EyasError):
    pass


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    def validate(self) -> None:
        if self.temperature < 0:
            raise EngineError(f"temperature {self.temperature} < 0; use 0 for greedy or a positive value")
        if 0 < self.temperature < MIN_TEMPERATURE:
            # fp32 logits divided by it overflow to inf and the softmax turns to NaN
            raise EngineError(f"temperature {self.temperature} is too small to sample with; use 0 for greedy "
                              f"decoding or a temperature >= {MIN_TEMPERATURE}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise EngineError(f"seed {self.seed} is outside the signed 64-bit range {SEED_MIN}..{SEED_MAX}; "
                              "pass a seed in that range")
        if not 0.0 < self.top_p <= 1.0:
            raise EngineError(f"top_p {self.top_p} must be in (0, 1]; use 1.0 to turn it off")
        if self.top_k < 0:
            raise EngineError(f"top_k {self.top_k} < 0; use 0 to turn it off")
        if self.max_new_tokens < 1:
            raise EngineError(f"max_new_tokens {self.max_new_tokens} must be >= 1")
        if any(not s for s in self.stop):
            raise EngineError("stop strings must be non-empty")


# The tree generate, serve, bench and the recipe's eval draft when none is given, per device (measured with eyas
# 0.1.0, docs/RESULTS.md). On a 2-core AMD EPYC Zen 3 each verified row costs ~10-25% of a decode step and a draft
# step ~15%, so only a small pruned tree plus lookup comes near plain decoding with today's draft; a GPU verifies
# dozens of rows for about the price of one. CUDA's is the engine's full tree (SpecParams' own defaults, what the
# doctor's trace follows).
# Any: the int knobs and min_prob's float share one dict (SpecParams reads each as its own field type)
FULL_TREE: dict[str, Any] = {"steps": 4, "depth": 4, "topk": 4, "tokens": 16, "lookup": 0, "min_prob": 0.0}
TREE_DEFAULTS = {"cpu": {**FULL_TREE, "depth": 2, "topk": 2, "tokens": 3, "lookup": 4, "min_prob": 0.35},
                 "cuda": FULL_TREE}


# method lookup's chain length (any device): replaying 80 MT-bench and 40 HumanEval plain outputs with the
# native row costs of a 2-core AMD EPYC Zen 3 (benchmarks/lookup_sim.py), lengths 2 and 3 tie for the best
# speedup (1.19x / 1.32x over the first 128 / 256 tokens of MT-bench replies) and 3 accepts more per round;
# 4 loses 2-3%, 8 about 15%.
LOOKUP_ALONE = 3


def device_kind(device: str | None) -> str:
    """The TREE_DEFAULTS row of a --device: "cuda" for cuda and cuda:N, "cpu" otherwise."""
    return "cuda" if str(device).startswith("cuda") else "cpu"


def default_help(key: str) -> str:
    """A TREE_DEFAULTS entry for a --help string: "default 2 on the CPU, 4 on CUDA"."""
    cpu, cuda = TREE_DEFAULTS["cpu"][key], TREE_DEFAULTS["cuda"][key]
    return f"default {cpu:g}" if cpu == cuda else f"default {cpu:g} on the CPU, {cuda:g} on CUDA"


def defaults_text(device: str) -> str:
    """TREE_DEFAULTS for `device` as the README and the Makefile state them (a test holds them to it):
    "depth 2, topk 2, 3 tokens, lookup 4, min-prob 0.35"."""
    d = TREE_DEFAULTS[device]
    return (f"depth {d['depth']}, topk {d['topk']}, {d['tokens']} tokens, lookup {d['lookup']}, "
            f"min-prob {d['min_prob']:g}")


@dataclass
class TreeSettings:
    """The tree, chain and lookup knobs as a command was given them; None = the device's default for the method
    (TREE_DEFAULTS), filled in by `spec`, the one place a SpecParams is built. generate, serve, bench, the recipe's
    eval, replay and the doctor all hold one of these."""

    steps: int | None = option("--steps", f"chain: draft steps per round, verifying steps + 1 tokens "
                                        f"({default_help('steps')})")
    depth: int | None = option("--depth", f"tree: draft depth ({default_help('depth')})")
    topk: int | None = option("--topk", f"tree: children per expanded node and frontier width ({default_help('topk')})")
    tokens: int | None = option("--tokens", "tree: tokens verified per round, root included "
                                            f"({default_help('tokens')})")
    lookup: int | None = option("--lookup", f"lookup candidates merged into the tree per round (0 = off; "
                                          f"{default_help('lookup')}; method lookup: the chain's length, default "
                                          f"{LOOKUP_ALONE})")
    min_prob: float | None = option("--min-prob", "tree and chain: verify only candidates whose cumulative draft "
                                                f"probability reaches this ({default_help('min_prob')})")

    def resolved(self, method: str, device: str | None = "cpu") -> dict[str, Any]:
        """Every knob for `method` on `device`: given values kept, the rest from TREE_DEFAULTS; device None = the
        engine's full tree (FULL_TREE). Plain decoding drafts nothing, so its lookup and min-prob default to off
        (a given value is kept, and refused by SpecParams.validate); method lookup's chain defaults to LOOKUP_ALONE
        tokens, its min-prob to off."""
        base = FULL_TREE if device is None else TREE_DEFAULTS[device_kind(device)]
        if method == "plain":
            base = {**base, "lookup": 0, "min_prob": 0.0}
        if method == "lookup":
            base = {**base, "lookup": LOOKUP_ALONE, "min_prob": 0.0}
        given = asdict(self)
        return {k: base[k] if given[k] is None else given[k] for k in base}

    def spec(self, method: str, device: str | None = "cpu", *, weights: str = "auto",
             draft_weights: str = "auto") -> SpecParams:
        """The SpecParams of `method` on `device` (see `resolved`)."""
        return SpecParams(method=method, weights=weights, draft_weights=draft_weights,
                          **self.resolved(method, device))


def draft_needed(method: str) -> EngineError:
    """The one refusal of a drafting method given `--draft none` (resolve_method, and make_engine for specs built
    elsewhere)."""
    return EngineError(f"--method {method} needs a draft: pass --draft PATH (an eyas draft folder), 'default' or "
                       "'random' (untrained: the plumbing, not the speed), or use --method plain")


def resolve_method(method: str | None, draft: str | None) -> tuple[str, str]:
    """The one rule for --method and --draft (generate, serve, doctor trace): (method, draft spec to load).
    No --method: tree, or plain with --draft none. A drafting method needs a draft (unset = the bundled one);
    plain and lookup load none, so a --draft given with them is refused rather than silently ignored."""
    if method is None:
        method = "plain" if draft == "none" else "tree"
    if method not in METHODS:
        raise EngineError(f"--method {method!r}: expected one of {', '.join(METHODS)}")
    if method in DRAFT_METHODS:
        if draft == "none":
            raise draft_needed(method)
        return method, draft or "default"
    if draft not in (None, "none"):
        raise EngineError(f"--method {method} decodes without a draft, but --draft {draft} was given: drop --draft "
                          "(or pass --draft none), or use --method tree|chain to decode with the draft")
    return method, "none"


@dataclass
class SpecParams:
    method: str = "tree"  # tree | chain | lookup (the lookup chain alone: no draft) | plain
    steps: int = FULL_TREE["steps"]  # chain: draft steps per round (verifies steps + 1 tokens)
    depth: int = FULL_TREE["depth"]  # tree: draft depth
    topk: int = FULL_TREE["topk"]  # tree: children per expanded node and frontier width
    tokens: int = FULL_TREE["tokens"]  # tree: verified tokens per round, root included
    # lookup candidates merged into the tree per round (0 = EAGLE-3 only; eyas.engine.lookup)
    lookup: int = FULL_TREE["lookup"]
    lookup_ngram: int = 3  # longest context suffix matched for lookup (down to 2 tokens)
    # tokens the engine's n-gram table (eyas.engine.ngram) proposes in a round where context lookup found nothing:
    # replaying 80 MT-bench plain outputs, 1 beat 2 and 3 (a table token is accepted ~30% of the time and each
    # verified row costs ~14% of a step on a 2-core AMD EPYC Zen 3)
    ngram_tokens: int = 1
    # tree: verify only candidates the draft gives at least this probability (cumulative along the path), so a
    # round where the draft is unsure verifies fewer rows, down to the root alone (a plain step); 0 = off
    min_prob: float = FULL_TREE["min_prob"]
    weights: str = "auto"  # target forward: auto | native (a GGUF's quantized weights) | fp32 (eyas.model)
    draft_weights: str = "auto"  # auto (q8 with a native target) | q8 (eyas.native.quant.Q8Linear) | fp32

    def describe(self) -> str:
        """The knobs that shape what this method verifies: "chain k=3", "tree depth 2, topk 2, 3 tokens, lookup 4,
        min-prob 0.35", "lookup 3", "plain"."""
        if self.method == "plain":
            return "plain"
        if self.method == "lookup":
            return f"lookup {self.lookup}"
        text = f"chain k={self.steps}" if self.method == "chain" else \
            f"tree depth {self.depth}, topk {self.topk}, {self.tokens} tokens"
        if self.lookup:
            text += f", lookup {self.lookup}"
        if self.min_prob:
            text += f", min-prob {self.min_prob:g}"
        return text

    def shape(self) -> tuple[int, int, int]:
        """(depth, topk, tokens) of the tree this method drafts (a chain is a topk-1 tree)."""
        if self.method == "chain":
            return self.steps, 1, self.steps + 1
        if self.method == "lookup":
            return 0, 1, 1  # the root; the lookup chain comes on top
        return self.depth, self.topk, self.tokens

    def check(self) -> None:
        """What validate refuses that needs no loaded draft, so bad flags fail before anything loads; the bound
        that needs the draft (topk within its vocabulary) waits for the Engine's validate."""
        self._validate(None, self.method in DRAFT_METHODS)

    def validate(self, draft_vocab: int | None) -> None:
        """draft_vocab: the loaded draft's vocabulary size, None without a draft."""
        self._validate(draft_vocab, draft_vocab is not None)

    def _validate(self, draft_vocab: int | None, has_draft: bool) -> None:
        if self.weights not in WEIGHTS:
            raise EngineError(f"--weights {self.weights!r}: expected one of {', '.join(WEIGHTS)}")
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise EngineError(f"--draft-weights {self.draft_weights!r}: expected one of {', '.join(DRAFT_WEIGHTS)}")
        if self.method not in METHODS:
            raise EngineError(f"method {self.method!r}: expected one of {', '.join(METHODS)}")
        if not 0.0 <= self.min_prob < 1.0:
            raise EngineError(f"min_prob {self.min_prob} must be in [0, 1) (0 = verify every selected candidate)")
        if self.lookup < 0 or self.lookup_ngram < 2:
            raise EngineError(f"lookup {self.lookup} must be >= 0 and lookup_ngram {self.lookup_ngram} >= 2")
        if self.ngram_tokens < 1:
            raise EngineError(f"ngram_tokens {self.ngram_tokens} must be >= 1 (pass no n-gram table to turn it off)")
        if self.method == "plain":
            if self.lookup:
                raise EngineError("lookup candidates are merged into a draft's tree: use method tree or chain "
                                  "with --lookup, or --lookup 0 with method plain")
            return
        if self.method == "lookup":
            if self.lookup < 1:
                raise EngineError("method lookup verifies the lookup chain alone: give it --lookup 1 or more")
            if self.min_prob:
                raise EngineError("--min-prob filters a draft's candidates; method lookup drafts nothing: "
                                  "drop --min-prob")
            return
        if not has_draft:
            raise EngineError(f"method {self.method!r} needs an EAGLE-3 draft; pass a draft (--draft PATH or "
                              "--draft default) or use method 'plain'")
        if self.method == "chain":
            if self.steps < 1:
                raise EngineError(f"chain steps {self.steps} < 1; use --steps 1 or more (or method 'plain')")
            return
        d, k, n = self.depth, self.topk, self.tokens
        if d < 1:
            raise EngineError(f"tree depth {d} < 1; use --depth 1 or more")
        if k < 1:
            raise EngineError(f"tree topk {k} < 1; use --topk 1 or more")
        if draft_vocab is not None and k > draft_vocab:
            raise EngineError(f"tree topk {k} exceeds the draft vocabulary ({draft_vocab} tokens)")
        if k == 1 and n != d + 1:
            raise EngineError(f"a tree with topk 1 is a chain of {d} tokens: tokens must be depth + 1 = {d + 1}, "
                              f"got {n}. Use --tokens {d + 1}, or --topk > 1 for a wider tree")
        cap = 1 + k + (d - 1) * k * k
        if n < 2:
            raise EngineError(f"tree tokens {n} < 2: it counts the root, so at least one candidate needs 2")
        if n > cap:
            raise EngineError(f"tree tokens {n} exceed what depth {d} x topk {k} can propose: at most "
                              f"1 + topk + (depth-1)*topk^2 = {cap} (root included). Use --tokens <= {cap} "
                              "or a larger --depth/--topk")
