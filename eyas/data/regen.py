"""The target writes the replies: batched generation for `eyas datagen --regenerate`.

Llama-family targets run through eyas's own forward (eyas/engine/forward.py) with a static KV cache. Each batch's
prompts are left-padded to one length. A per-row key mask hides the padding, and each row's positions start
at 0, so a row computes what it would alone. Rows that finished leave the batch: the cache is compacted
once a quarter of the rows are done, so the batch does not keep computing finished rows. Sampling draws
every row from one generator seeded per batch, so a rerun repeats it. Families the engine forward does not
cover fall back to Hugging Face `generate`.

Which weights the engine runs is `--regen-weights` (DatagenConfig.regen_weights, eyas.engine.weights.engine_model's
modes): auto = native for a GGUF target on the CPU, the numerics eyas serves with, so the replies are the
tokens `eyas generate` and `eyas serve` give; its 4-bit kernel shares each weight tile among 8 outputs and 4
rows (benchmarks/bench_datagen.py: ~1.9x the fp32 weights end to end at 64 rows). fp32 runs the HF weights in
--target-dtype.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import groupby
from typing import cast

import torch

from ..engine.forward import TargetModel
from ..engine.sampling import warp
from ..engine.weights import engine_model
from ..target.family import ModelError
from ..target.load import Target, end_token_ids
from ..target.template import chat_ids
from .conversations import Conversation, loop_end, render

# --data self (Magpie-style): the user turn is sampled from the template's opening up to the user's text
SELF_PROMPT_TEMPERATURE = 1.0
SELF_PROMPT_TOP_P = 1.0
SELF_PROMPT_TOKENS = 256  # a user turn still open after this many tokens is dropped, not cut
SELF_PROMPT = f"t={SELF_PROMPT_TEMPERATURE} top_p={SELF_PROMPT_TOP_P} max={SELF_PROMPT_TOKENS} v1"  # manifest

Reply = tuple[list[int], str]  # reply tokens without the end token; why it ended: eos | repetition | length


def stop_token_ids(target: Target) -> list[int]:
    """Where a regenerated reply ends: the target's end-of-turn tokens (eyas.target.end_token_ids)."""
    return end_token_ids(target.tokenizer, target.model,
                         "regeneration could never stop: use --no-regenerate or fix the config")


def regen_engine(target: Target, weights: str = "auto") -> TargetModel | None:
    """The engine forward regeneration runs on in `weights` mode (eyas.engine.params.WEIGHTS), or None when the
    family needs HF generate."""
    m = target.model
    try:
        if weights != "fp32":
            tm = engine_model(target, weights)  # an explicit native mode that cannot run raises
            if tm.native is not None:
                return tm
        return TargetModel(m, kernel_attention=m.dtype == torch.float32 and m.device.type == "cpu")
    except ModelError:
        if weights in ("native", "native-bf16"):
            raise
        return None


def engine_for(target: Target, cfg) -> TargetModel | None:
    """regen_engine for cfg (DatagenConfig), or None when vLLM writes the replies (cfg.vllm_session): the target
    was then loaded without weights, so eyas builds no forward of its own."""
    if getattr(cfg, "vllm_session", None) is not None:
        return None
    return regen_engine(target, cfg.regen_weights)


def vllm_generate(session, prompts: list[list[int]], caps: list[int], stop_ids: list[int], repetition_limit: int,
                  temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> list[Reply]:
    """Replies written by vLLM (eyas.vllm.session.VllmSession), ended by eyas's rules: at the first end-of-turn
    token, or where the reply first completes a repetition_limit-token loop (vLLM has no such stop, so it may
    write past the loop; the reply is cut there, the same prefix eyas's engine stops at), or at its cap. Each
    request is seeded from `seed` and its index, so a rerun of a sampled chunk repeats it."""
    out = session.call({"op": "generate", "prompts": prompts, "max_tokens": caps, "temperature": temperature,
                        "top_p": top_p, "seeds": [(seed + j) % (2**31) for j in range(len(prompts))],
                        "stop_ids": stop_ids})
    stops = set(stop_ids)
    replies: list[Reply] = []
    for toks, finish in zip(out["replies"], out["finish"], strict=True):
        end = next((j for j, t in enumerate(toks) if t in stops), None)
        body = toks if end is None else toks[:end]
        loop = loop_end(body, repetition_limit)
        if loop is not None:
            replies.append((body[:loop], "repetition"))
        elif end is not None or finish == "stop":  # vLLM's own eos (its generation config) ends a turn too
            replies.append((body, "eos"))
        else:
            replies.append((body, "length"))
    return replies


def regen_numerics(engine: TargetModel | None) -> str:
    """What wrote the replies, for the manifest: hf-generate, eyas-fp32 (HF weights) or eyas-native."""
    if engine is None:
        return "hf-generate"
    return "eyas-native" if engine.native is not None else "eyas-fp32"


class _LoopWatch:
    """Incremental eyas.data.conversations.loop_end for one growing reply."""

    def __init__(self, n: int):
        self.n = n
        self.seen: set[tuple[int, ...]] = set()

    def closes_loop(self, reply: list[int]) -> bool:
        if self.n <= 0 or len(reply) < self.n:
            return False
        w = tuple(reply[-self.n:])
        if w in self.seen:
            return True
        self.seen.add(w)
        return False


@dataclass
class _Row:
    job: int
    length: int  # tokens in the cache row (prompt + reply so far)
    reply: list[int]
    watch: _LoopWatch
    cap: int


class _Pool:
    """Up to `width` jobs decoding together in one KV cache: row r's tokens sit in slots [0, length_r) of its
    own cache row, so a row that finishes takes the next job at once (its prompt prefilled alone, its K/V
    copied in). Once the queue is empty, finished rows are compacted out."""

    def __init__(self, model: TargetModel, prompts: list[list[int]], caps: list[int], width: int, sample,
                 repetition_limit: int):
        self.model, self.prompts, self.caps, self.sample = model, prompts, caps, sample
        self.repetition_limit = repetition_limit
        self.queue = list(range(len(prompts)))[::-1]  # pop() takes the next job in order
        slots = max(len(p) + c for p, c in zip(prompts, caps, strict=True))
        self.cache = model.new_cache(min(width, len(prompts)), slots)
        self.rows: list[_Row | None] = [None] * self.cache.k.shape[1]
        self.next: list[int] = [0] * len(self.rows)  # the token each row feeds at the next step

    def admit(self, r: int) -> int | None:
        """Prefill the next job into row r; -> its first token (None when the queue is empty)."""
        if not self.queue:
            self.rows[r] = None
            return None
        j = self.queue.pop()
        p = self.prompts[j]
        one = self.model.new_cache(1, len(p))
        pos = torch.arange(len(p), device=self.model.device)[None]
        fo = self.model.forward(torch.tensor([p], device=self.model.device), pos, one)
        assert fo.logits is not None  # logits="last", forward's default
        logits = fo.logits[:, -1]
        self.cache.k[:, r, :, :len(p)] = one.k[:, 0]
        self.cache.v[:, r, :, :len(p)] = one.v[:, 0]
        self.rows[r] = _Row(j, len(p), [], _LoopWatch(self.repetition_limit), self.caps[j])
        return int(self.sample(logits)[0])

    def compact(self) -> None:
        keep = [r for r, row in enumerate(self.rows) if row is not None]
        n = max(row.length for row in self.rows if row is not None)
        idx = torch.tensor(keep, device=self.model.device)
        new = self.model.new_cache(len(keep), self.cache.max_len)
        new.k[:, :, :, :n] = self.cache.k[:, idx, :, :n]
        new.v[:, :, :, :n] = self.cache.v[:, idx, :, :n]
        self.cache = new
        self.rows = [self.rows[r] for r in keep]
        self.next = [self.next[r] for r in keep]


@torch.no_grad()
def engine_generate(model: TargetModel, prompts: list[list[int]], max_new: list[int], stop_ids: list[int],
                    repetition_limit: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                    width: int = 64, progress: Callable[[int, int], None] | None = None) -> list[Reply]:
    """Per prompt, the target's reply (greedy at temperature 0, else sampled from one seeded generator) of at
    most max_new[b] tokens; at most `width` prompts decode at once, the next one joining as one finishes.
    progress(replies finished, tokens generated) is called every 32 decode steps and as each reply finishes."""
    dev = model.device
    gen = torch.Generator(device=dev).manual_seed(seed) if temperature > 0 else None

    def sample(logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B]
        if gen is None:
            return logits.argmax(-1)
        return torch.multinomial(warp(logits, temperature, 0, top_p), 1, generator=gen)[:, 0]

    stops = set(stop_ids)
    done: list[Reply | None] = [None] * len(prompts)
    pool = _Pool(model, prompts, max_new, width, sample, repetition_limit)

    def take(r: int, t: int | None) -> None:
        """Row r produced token t: record it, or finish the row's job and refill the row."""
        while t is not None:
            row = pool.rows[r]
            assert row is not None  # a token comes from an admitted row
            if t in stops:
                done[row.job] = (row.reply, "eos")
            else:
                row.reply.append(t)
                if row.watch.closes_loop(row.reply):
                    done[row.job] = (row.reply, "repetition")
                elif len(row.reply) >= row.cap:
                    done[row.job] = (row.reply, "length")
                else:
                    pool.next[r] = t
                    return
            t = pool.admit(r)

    for r in range(len(pool.rows)):
        take(r, pool.admit(r))
    step, reported = 0, 0
    while any(row is not None for row in pool.rows):
        step += 1
        finished = [d for d in done if d is not None] if progress else []
        if progress and (step % 32 == 0 or len(finished) > reported):  # and as each reply finishes
            live = sum(len(row.reply) for row in pool.rows if row is not None)
            progress(len(finished), live + sum(len(r) for r, _ in finished))
            reported = len(finished)
        idle = sum(row is None for row in pool.rows)
        if idle and idle >= len(pool.rows) // 4:  # the queue is empty: stop computing finished rows
            pool.compact()
        rows = pool.rows
        lengths = torch.tensor([row.length if row else 0 for row in rows], device=dev)  # [B]
        cache = pool.cache
        cache.length = int(lengths.max())
        T = cache.length + 1
        # row b sees its own slots [0, length_b] (the new token's included); an idle row sees slot 0 only
        mask = torch.arange(T, device=dev)[None, :] <= lengths[:, None]  # [B, T]
        ids = torch.tensor(pool.next, device=dev)[:, None]  # [B, 1]
        fo = model.forward(ids, lengths[:, None], cache, attn_mask=mask[:, None, None], slots=lengths, logits="last")
        assert fo.logits is not None  # logits="last"
        logits = fo.logits[:, -1]  # [B, V]
        nxt = sample(logits).tolist()
        for r, row in enumerate(rows):
            if row is not None:
                row.length += 1
                take(r, nxt[r])
    return [d for d in done if d is not None]


def _loop_criteria(n: int, prompt_len: int):
    from transformers import StoppingCriteria

    class LoopStop(StoppingCriteria):
        """Per row: stop once the last n generated tokens already occurred as an earlier n-token window of the
        reply (the same rule as eyas.data.conversations.loop_end, checked after every new token)."""

        def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
            gen = input_ids[:, prompt_len:]  # [B, T]
            T = gen.shape[1]
            # bool tensors; torch's stubs type them Tensor, HF's StoppingCriteria declares BoolTensor
            if T <= n:
                return cast(torch.BoolTensor, torch.zeros(gen.shape[0], dtype=torch.bool, device=gen.device))
            earlier = gen[:, :T - 1].unfold(1, n, 1)  # [B, T-n, n] windows starting before the last one
            return cast(torch.BoolTensor, (earlier == gen[:, None, T - n:]).all(dim=-1).any(dim=-1))  # [B]

    return LoopStop()


@torch.no_grad()
def hf_generate(target: Target, prompts: list[list[int]], max_new: int, stop_ids: list[int],
                repetition_limit: int, temperature: float = 0.0, top_p: float = 1.0,
                seed: int = 0) -> list[Reply]:
    """The fallback for families eyas's forward does not cover: one batched HF generate, left padding."""
    from transformers import GenerationConfig, StoppingCriteriaList

    dev = target.device
    pad = target.tokenizer.pad_token_id
    pad = stop_ids[0] if pad is None else int(pad)
    S = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), S), pad, dtype=torch.long)
    am = torch.zeros((len(prompts), S), dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding: every row's next token lands in the last column
        ids[b, S - len(p):] = torch.tensor(p)
        am[b, S - len(p):] = 1
    sample = temperature > 0
    gc = GenerationConfig(max_new_tokens=max_new, do_sample=sample, temperature=temperature if sample else None,
                          top_p=top_p if sample else None, top_k=0 if sample else None,
                          eos_token_id=stop_ids, pad_token_id=pad)
    crit = StoppingCriteriaList([_loop_criteria(repetition_limit, S)]) if repetition_limit > 0 else None
    torch.manual_seed(seed)
    # a *ForCausalLM: generate is GenerationMixin's, which PreTrainedModel does not declare
    out = target.model.generate(input_ids=ids.to(dev), attention_mask=am.to(dev), generation_config=gc,  # type: ignore[operator]
                                stopping_criteria=crit)
    stops = set(stop_ids)
    results: list[Reply] = []
    for row in out[:, S:].tolist():
        # the reply ends at the first end token, or where it first completes a loop, whichever comes first
        end = next((j for j, t in enumerate(row) if t in stops), None)
        loop = loop_end(row, repetition_limit)
        if end is not None and (loop is None or end < loop):
            results.append((row[:end], "eos"))
        elif loop is not None:
            results.append((row[:loop], "repetition"))
        else:
            results.append((row, "length"))
    return results


def generate_replies(target: Target, prompts: list[list[int]], cfg, seed: int, stop_ids: list[int],
                     engine: TargetModel | None = None,
                     progress: Callable[[int, int], None] | None = None) -> list[Reply]:
    """Replies to `prompts` under cfg's (DatagenConfig) max_new_tokens, max_len, repetition_limit,
    temperature, top_p, gen_batch and gen_tokens: through `engine` when given (all prompts in one pool of at
    most gen_batch rows whose KV cache holds at most gen_tokens slots), else one HF generate call."""
    caps = [max(1, min(cfg.max_new_tokens, cfg.max_len - len(p))) for p in prompts]
    opts = dict(repetition_limit=cfg.repetition_limit, temperature=cfg.temperature, top_p=cfg.top_p, seed=seed)
    if getattr(cfg, "vllm_session", None) is not None:  # vLLM schedules and batches the prompts itself
        return vllm_generate(cfg.vllm_session, prompts, caps, stop_ids, **opts)
    if engine is not None:
        # one pool per width class: a long prompt narrows only the pool of the prompts as long as it
        # (widths fall as lengths rise, so sorting by length makes each class one run of jobs)
        width_of = [max(1, min(cfg.gen_batch, cfg.gen_tokens // (len(p) + c)))
                    for p, c in zip(prompts, caps, strict=True)]
        order = sorted(range(len(prompts)), key=lambda j: len(prompts[j]) + caps[j])
        out: list[Reply | None] = [None] * len(prompts)
        base_n = base_tok = 0  # replies and tokens of the classes already done, for progress
        for width, run in groupby(order, key=lambda j: width_of[j]):
            group = list(run)
            report = None if progress is None else lambda n, t, a=base_n, b=base_tok: progress(a + n, b + t)
            replies = engine_generate(engine, [prompts[j] for j in group], [caps[j] for j in group], stop_ids,
                                      width=width, progress=report, **opts)
            for j, rep in zip(group, replies, strict=True):
                out[j] = rep
            base_n, base_tok = base_n + len(group), base_tok + sum(len(r) for r, _ in replies)
        return [r for r in out if r is not None]
    return hf_generate(target, prompts, max(caps), stop_ids, **opts)


def user_turn_opening(tokenizer) -> list[int]:
    """The ids the chat template renders before a first user message's text (its default system prompt and the
    user header included): what the target continues to write a user turn of its own."""
    sentinel = "\x00EYAS-USER\x00"
    text = render(tokenizer, [{"role": "user", "content": sentinel}])
    if text.count(sentinel) != 1:
        raise ValueError("the chat template does not render the user's text verbatim, so --data self cannot find "
                         "where a user turn starts; use a file of conversations as --data")
    return [int(t) for t in tokenizer(text.split(sentinel)[0], add_special_tokens=False)["input_ids"]]


def sample_user_turns(target: Target, convs: list[Conversation], cfg, stats: Counter, skips: Counter,
                      on_progress: Callable[[str], None] | None = None) -> list[Conversation]:
    """--data self: each row's user turn is the target's own, sampled (SELF_PROMPT) from the template's opening
    and ended by its end-of-turn token, so the prompts are the kind the target was tuned to answer (Magpie, Xu et
    al. 2024) and no prompt file is needed. A turn that is empty, loops, runs past SELF_PROMPT_TOKENS or repeats
    an earlier row's of the chunk is skipped, counted by reason."""
    if not convs:
        return []
    tok = target.tokenizer
    opening = user_turn_opening(tok)
    if on_progress:
        on_progress("self prompts")
    gen_cfg = replace(cfg, temperature=SELF_PROMPT_TEMPERATURE, top_p=SELF_PROMPT_TOP_P,
                      max_new_tokens=SELF_PROMPT_TOKENS)
    seed = (cfg.seed * 1_000_003 + convs[0].row_id * 1_009 + 7_919) % (2**63)
    t0 = time.perf_counter()

    def report(n: int, toks: int) -> None:
        if on_progress:
            on_progress(f"self prompts: {n}/{len(convs)}, {toks} tok "
                        f"({toks / max(time.perf_counter() - t0, 1e-9):.0f} tok/s)")

    turns = generate_replies(target, [opening] * len(convs), gen_cfg, seed, stop_token_ids(target),
                             engine_for(target, cfg), report)
    stats["self_prompt_ms"] += int(1000 * (time.perf_counter() - t0))
    out, seen = [], set()
    for c, (ids, why) in zip(convs, turns, strict=True):
        text = tok.decode(ids, skip_special_tokens=False).strip()
        reason = ("self_prompt_unfinished" if why == "length" else "self_prompt_loop" if why == "repetition"
                  else "self_prompt_empty" if not text else "self_prompt_duplicate" if text in seen else None)
        if reason:
            skips[reason] += 1
            continue
        seen.add(text)
        stats["self_prompts"] += 1
        stats["self_prompt_tokens"] += len(ids)
        out.append(Conversation(c.row_id, [{"role": "user", "content": text},
                                           {"role": "assistant", "content": ""}]))  # the reply: regenerate
    return out


def regenerate(target: Target, convs: list[Conversation], cfg, stats: Counter, batches,
               on_progress: Callable[[str], None] | None = None,
               on_replies: Callable[[int, int], None] | None = None) -> list[Conversation]:
    """Replace every assistant reply with the target's own, given the conversation so far (its own earlier
    replies, the original user turns). Turn by turn: the engine takes a turn's prompts in one pool; HF generate
    takes them batched by length (`batches(lengths) -> index groups`). A turn whose prompt already fills max_len
    is dropped with everything after it (truncation would cut it anyway). on_replies(done, total): replies
    finished of those the conversations still need, as they finish (datagen's bar and ETA move from the first)."""
    tok = target.tokenizer
    stop_ids = stop_token_ids(target)
    engine = engine_for(target, cfg)
    whole_turn = engine is not None or getattr(cfg, "vllm_session", None) is not None
    msgs = [[dict(m) for m in c.messages] for c in convs]
    turns = [[i for i, m in enumerate(ms) if m["role"] == "assistant"] for ms in msgs]
    cut = [len(ms) for ms in msgs]  # messages kept per conversation
    done, total = 0, sum(len(t) for t in turns)

    def replies_done(n: int) -> None:
        if on_replies:
            on_replies(done + n, total)

    for r in range(max((len(t) for t in turns), default=0)):
        jobs: list[tuple[int, int, list[int]]] = []
        for ci, t in enumerate(turns):
            if r >= len(t) or t[r] >= cut[ci]:
                continue
            i = t[r]
            prompt = chat_ids(tok, msgs[ci][:i])  # message text as text, like serving
            if len(prompt) >= cfg.max_len:
                cut[ci] = i
                stats["turns_dropped_context_full"] += len(t) - r
                total -= len(t) - r
                continue
            jobs.append((ci, i, prompt))
        lens = [len(p) + min(cfg.max_new_tokens, cfg.max_len - len(p)) for _, _, p in jobs]
        # the engine's pool refills rows as replies finish (and vLLM schedules its own batches), so either takes
        # a whole turn at once
        groups = ([sorted(range(len(jobs)), key=lambda j: lens[j])] if whole_turn and jobs
                  else batches(lens))
        for bi, batch in enumerate(groups):
            if on_progress:
                on_progress(f"regen turn {r + 1} batch {bi + 1}")
            first_row = convs[jobs[batch[0]][0]].row_id
            seed = (cfg.seed * 1_000_003 + first_row * 1_009 + r) % (2**63)
            t0 = time.perf_counter()
            def report(n: int, toks: int, r=r, bi=bi, total=len(batch), t0=time.perf_counter()) -> None:
                replies_done(n)
                if on_progress:
                    on_progress(f"regen turn {r + 1} batch {bi + 1}: {n}/{total} replies, {toks} tok "
                                f"({toks / max(time.perf_counter() - t0, 1e-9):.0f} tok/s)")

            replies = generate_replies(target, [jobs[j][2] for j in batch], cfg, seed, stop_ids, engine, report)
            stats["regen_ms"] += int(1000 * (time.perf_counter() - t0))
            done += len(batch)
            replies_done(0)
            for j, (reply, why) in zip(batch, replies, strict=True):
                ci, i, _ = jobs[j]
                msgs[ci][i] = {"role": "assistant", "content": tok.decode(reply, skip_special_tokens=False)}
                stats["regenerated_replies"] += 1
                stats["regenerated_tokens"] += len(reply)
                stats[f"finish_{why}"] += 1
    return [Conversation(row_id=c.row_id, messages=ms[:n], dropped_turns=c.dropped_turns)
            for c, ms, n in zip(convs, msgs, cut, strict=True)]
