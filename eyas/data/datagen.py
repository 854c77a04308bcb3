"""`eyas datagen`: conversations -> (optional) target-regenerated replies -> hidden-state shards, resumable.

Rows are processed in source order, a chunk of --shard-samples conversations at a time. Each chunk is
regenerated (batched across conversations, turn by turn), tokenized with the assistant loss mask, captured
(batched by similar length, right padding + attention mask, real tokens sliced out) and written as shard
file(s); then the manifest is committed with a watermark = the last source row the chunk covered. Every row
up to the watermark is either in a committed shard or counted as skipped, so a rerun of the same command
continues after the watermark; a shard file the manifest does not list (a kill between the shard rename and
the manifest rename) is removed first. No sample is lost or duplicated.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..engine.weights import WEIGHTS
from ..errors import EyasError
from ..files import atomic_write_json, damaged
from ..layout import Layout, LayoutError, check_layouts
from ..target.capture import capture
from ..target.convert import file_fingerprint
from ..target.device import parse_dtype
from ..target.load import Target, load_target
from ..target.template import (
    ChatTemplate,
    describe_record,
    fix_for,
    raw_ids,
    require_template,
    resolve_template,
    same_template,
    use_template,
)
from ..vllm.env import VllmError, vllm_python, vllm_version
from ..vllm.session import VllmSession, aux_ids
from .conversations import (
    SELF_SOURCE,
    Conversation,
    DataError,
    Skip,
    iter_source,
    plain_text,
    raw_prompt_text,
    resolve_source,
    self_rows,
    tokenize_conversation_checked,
    tokenize_raw,
)
from .regen import (
    SELF_PROMPT,
    engine_for,
    generate_replies,
    regen_engine,
    regen_numerics,
    regenerate,
    sample_user_turns,
    stop_token_ids,
    user_turn_opening,
)
from .shards import FORMAT_VERSION, KIND, MANIFEST, Sample, ShardError, load_manifest, write_shard

SHARD_GLOB = "shard-*.safetensors"

# why rows were skipped (the reasons of eyas.data.conversations, datagen and train's sources), and what to do
# when one of them skipped everything
SKIP_HINTS = {
    "template_error": "the chat template could not render these conversations: pass another --chat-template "
                      "(chatml, gemma, llama3 or a Jinja file), or --raw for plain text",
    "text_row_needs_raw": "the rows are plain-text documents ({'text'}), which have no chat to render: pass --raw",
    "prompt_fills_max_len": "the prompts alone fill --max-len, leaving no room for a reply: raise --max-len",
    "no_loss_tokens_after_truncation": "no assistant reply starts within --max-len tokens: raise --max-len",
    "no_loss_rows_within_max_len": "no assistant token falls within train's --max-len: raise --max-len",
    "no_assistant_turn": "the rows hold no assistant reply to learn from: give conversations with replies",
    "malformed": "the rows are not ShareGPT ('conversations': [{'from', 'value'}]) or OpenAI ('messages': "
                 "[{'role', 'content'}]) conversations",
    "unknown_role": "the rows use roles other than system/user/assistant (human/gpt in ShareGPT)",
    "empty_message": "the rows hold empty messages",
    "invalid_json": "the lines are not JSON",
    "self_prompt_unfinished": "the target's own user turns never reached its end-of-turn token: --data self needs a "
                              "chat-tuned target (or pass a file of conversations as --data)",
    "self_prompt_loop": "the target's own user turns looped: --data self needs a chat-tuned target",
}


def skip_summary(skipped: dict[str, int], top: int = 3) -> str:
    """'template_error 12, malformed 3 (+1 more reason); template_error: <what to do>': the most frequent skip
    reasons with their counts and the fix for the first. The datagen and train no-samples errors both use it."""
    ranked = sorted(((k, int(v)) for k, v in skipped.items() if v), key=lambda kv: (-kv[1], kv[0]))
    if not ranked:
        return "no rows were skipped"
    text = ", ".join(f"{k} {v}" for k, v in ranked[:top])
    if len(ranked) > top:
        more = len(ranked) - top
        text += f" (+{more} more reason{'s' if more > 1 else ''})"
    hint = SKIP_HINTS.get(ranked[0][0])
    return text + (f"; {ranked[0][0]}: {hint}" if hint else "")


class DatagenError(EyasError):
    """Bad options, a refused rerun or a numeric problem; the message says what was expected and the fix."""


@dataclass
class DatagenConfig:
    out: str
    target: str = "smollm2-135m"
    data: str = "sharegpt"
    num: int | None = None  # first N usable conversations from start_row (None = the rest of the source)
    start_row: int = 0  # source rows before this one are never read (a second run on unseen conversations)
    end_row: int | None = None  # source rows from this one on are never read (another folder starts there)
    max_len: int = 2048
    regenerate: bool = True
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 512
    max_turns: int | None = None  # keep at most this many assistant replies per conversation
    repetition_limit: int = 32  # stop a regenerated reply once its last n tokens repeat an earlier stretch; 0 = off
    dtype: str = "bf16"  # stored feature dtype
    target_dtype: str = "fp32"  # dtype the target runs in
    device: str = "cpu"
    aux_indices: list[int] | None = None  # None = the target's EAGLE-3 default
    shard_samples: int = 64  # conversations per chunk (and at most per shard)
    shard_tokens: int = 65536  # a chunk's samples are split into shards of at most this many tokens
    gen_batch: int = 64  # prompts decoding at once
    regen_weights: str = "auto"  # engine weights for regeneration (eyas.model.WEIGHTS; auto: native for a GGUF)
    gen_tokens: int = 65536  # KV-cache slots for generation (rows x longest prompt + new tokens): bounds memory
    capture_tokens: int = 8192  # padded tokens per capture forward: bounds activation memory
    threads: int = 0  # torch CPU threads (0 = torch's default); 1 is far faster on an oversubscribed machine
    chat_template: str | None = None  # --chat-template FILE|NAME (None: the tokenizer's own; eyas.template)
    raw: bool = False  # base models: rows as plain text, no template (see _raw_items for the loss mask)
    engine: str = "eyas"  # eyas | vllm: who runs the target (vllm: eyas.vllm.capture_worker, see _vllm_request)
    vllm_python: str | None = None  # --vllm-python (else $EYAS_VLLM_PYTHON, else .venv-vllm)
    vllm_tp: int = 1  # vLLM tensor_parallel_size
    vllm_pp: int = 1  # vLLM pipeline_parallel_size
    vllm_args: list[str] = field(default_factory=list)  # more vLLM engine args, KEY=VALUE (VALUE read as JSON)
    vllm_generator: str = "auto"  # shared | separate engine for the replies (auto: separate on CPU, shared on CUDA)
    vllm_session: Any = field(default=None, repr=False, compare=False)  # the running worker (run_datagen sets it)

    def template(self) -> ChatTemplate:
        return resolve_template(self.chat_template, self.raw)

    def validate(self) -> None:
        checks = [
            (self.num is None or self.num >= 0, f"--num must be >= 0, got {self.num}"),
            (self.start_row >= 0, f"--start-row must be >= 0, got {self.start_row}"),
            (self.end_row is None or self.end_row > self.start_row,
             f"--end-row must be > --start-row ({self.start_row}), got {self.end_row}"),
            (self.max_len >= 2, f"--max-len must be >= 2, got {self.max_len}"),
            (self.temperature >= 0, f"--temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p}"),
            (self.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {self.max_new_tokens}"),
            (self.max_turns is None or self.max_turns >= 1, f"--max-turns must be >= 1, got {self.max_turns}"),
            (self.repetition_limit >= 0, f"--repetition-limit must be >= 0 (0 = off), got {self.repetition_limit}"),
            (self.shard_samples >= 1, f"--shard-samples must be >= 1, got {self.shard_samples}"),
            (self.shard_tokens >= 1, f"--shard-tokens must be >= 1, got {self.shard_tokens}"),
            (self.gen_batch >= 1, f"--gen-batch must be >= 1, got {self.gen_batch}"),
            (self.regen_weights in WEIGHTS, f"--regen-weights must be one of {', '.join(WEIGHTS)}, got "
                                            f"{self.regen_weights!r}"),
            (self.capture_tokens >= 1, f"--capture-tokens must be >= 1, got {self.capture_tokens}"),
            (self.threads >= 0, f"--threads must be >= 0 (0 = torch's default), got {self.threads}"),
            (self.data != SELF_SOURCE or (self.regenerate and not self.raw),
             "--data self: the target writes the user turns and replies of a chat, so it needs --regenerate and "
             "no --raw"),
            (self.data != SELF_SOURCE or self.num is not None or self.end_row is not None,
             "--data self is an endless source: pass --num N (conversations) or --end-row E"),
            (self.engine in ENGINES, f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}"),
            (self.vllm_generator in ("auto", "shared", "separate"),
             f"--vllm-generator must be auto, shared or separate, got {self.vllm_generator!r}"),
            (self.vllm_tp >= 1 and self.vllm_pp >= 1,
             f"--vllm-tp and --vllm-pp must be >= 1, got {self.vllm_tp} and {self.vllm_pp}"),
            (self.engine == "vllm" or (self.vllm_tp == 1 and self.vllm_pp == 1 and not self.vllm_args),
             "--vllm-tp, --vllm-pp and --vllm-arg apply to --engine vllm only: add --engine vllm"),
        ]
        for ok, msg in checks:
            if not ok:
                raise DatagenError(msg)
        self.template()  # a bad --chat-template fails before anything loads
        vllm_engine_args(self)  # a malformed --vllm-arg too
        for name in (self.dtype, self.target_dtype):
            try:
                parse_dtype(name)
            except ValueError as e:
                raise DatagenError(f"{e} (expected bf16, fp16 or fp32)") from e


# config keys that define the dataset's content: a rerun into the same folder must match them
_IDENTITY_KEYS = ("source", "source_fingerprint", "start_row", "max_len", "regenerate", "max_turns", "dtype",
                  "target_dtype", "engine")
_REGEN_KEYS = ("temperature", "top_p", "seed", "max_new_tokens", "repetition_limit", "regen_weights")
_LEGACY = {"regen_weights": "fp32", "start_row": 0, "engine": "eyas"}  # manifests from before the key: what they ran


def _manifest_config(cfg: DatagenConfig, source: str, source_fp: str) -> dict[str, Any]:
    return {
        "source": source, "source_fingerprint": source_fp, "start_row": cfg.start_row, "max_len": cfg.max_len,
        "regenerate": cfg.regenerate,
        "temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed, "max_new_tokens": cfg.max_new_tokens,
        "max_turns": cfg.max_turns, "repetition_limit": cfg.repetition_limit, "dtype": cfg.dtype,
        "target_dtype": cfg.target_dtype, "num": cfg.num, "shard_samples": cfg.shard_samples,
        "shard_tokens": cfg.shard_tokens, "threads": torch.get_num_threads(),
        # vLLM writes the replies in its own numerics: a folder is never resumed with the other engine's
        "regen_weights": "vllm" if cfg.engine == "vllm" else cfg.regen_weights, "engine": cfg.engine,
    }


def _source_identity(data: str) -> tuple[str, str]:
    if data == SELF_SOURCE:
        return SELF_SOURCE, f"self-prompt {SELF_PROMPT}"  # a change to how user turns are sampled is refused
    path = resolve_source(data)
    return ("sharegpt" if data == "sharegpt" else str(path.resolve())), file_fingerprint([path])


# ---- batching ----------------------------------------------------------------------------------------

def length_batches(lengths: list[int], max_batch: int, token_budget: int) -> list[list[int]]:
    """Indices grouped by similar length (ascending) so padding stays small; each batch holds at most
    max_batch items and at most token_budget padded tokens (a single over-long item forms its own batch)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1 > max_batch or (len(cur) + 1) * lengths[i] > token_budget):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


# ---- regeneration (eyas/data/regen.py) ---------------------------------------------------------------

def limit_turns(messages: list[dict[str, str]], max_turns: int | None) -> list[dict[str, str]]:
    """Cut a conversation after its max_turns-th assistant reply."""
    if max_turns is None:
        return messages
    seen = 0
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            seen += 1
            if seen == max_turns:
                return messages[:i + 1]
    return messages


# ---- raw mode (base models) -----------------------------------------------------------------------------

RAW_DOC_PROMPT_TOKENS = 64  # raw regeneration: a document's first tokens are the prompt the target continues


def _raw_items(target: Target, convs: list[Conversation], cfg: DatagenConfig, stats: Counter, skips: Counter,
               on_progress: Callable[[str], None]) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """`datagen --raw`: each row as plain text (eyas.data.conversations.plain_text), tokenized as is with the
    tokenizer's own BOS rule, no template. What a base model's draft will be asked to continue is text, so:
    without regeneration every token is a loss token (the whole document is text the target predicts; a BOS is
    not); with regeneration the target continues the row's opening (a conversation's text before its first
    reply, a document's first RAW_DOC_PROMPT_TOKENS tokens) and only the continuation (+ its end token) is a
    loss token, as when serving a raw prompt."""
    tok = target.tokenizer
    items: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    if not cfg.regenerate:
        for c in convs:
            ids, mask, cut = tokenize_raw(tok, c, cfg.max_len)
            stats["truncated"] += int(cut)
            if int(mask.sum()) < 2:
                skips["no_loss_tokens_after_truncation"] += 1
                continue
            items.append((c.row_id, ids, mask))
        return items
    stop_ids = stop_token_ids(target)
    end = tok.eos_token_id if tok.eos_token_id in stop_ids else stop_ids[0]
    prompts: list[tuple[int, list[int]]] = []
    for c in convs:
        text = raw_prompt_text(c)
        ids = raw_ids(tok, text if text is not None else plain_text(c), as_text=True)
        if text is None:
            ids = ids[:RAW_DOC_PROMPT_TOKENS]
        if len(ids) >= cfg.max_len:
            skips["prompt_fills_max_len"] += 1
            continue
        prompts.append((c.row_id, ids))
    if not prompts:
        return items
    on_progress("regen raw")
    seed = (cfg.seed * 1_000_003 + prompts[0][0] * 1_009) % (2**63)
    t0 = time.perf_counter()
    replies = generate_replies(target, [p for _, p in prompts], cfg, seed, stop_ids, engine_for(target, cfg))
    stats["regen_ms"] += int(1000 * (time.perf_counter() - t0))
    for (row_id, prompt), (reply, why) in zip(prompts, replies, strict=True):
        stats["regenerated_replies"] += 1
        stats["regenerated_tokens"] += len(reply)
        stats[f"finish_{why}"] += 1
        cont = reply + ([end] if why == "eos" else [])
        ids = torch.tensor(prompt + cont, dtype=torch.long)[:cfg.max_len]
        mask = torch.zeros(len(prompt) + len(cont), dtype=torch.bool)
        mask[len(prompt):] = True
        mask = mask[:cfg.max_len]
        if not mask.any():
            skips["no_loss_tokens_after_truncation"] += 1
            continue
        items.append((row_id, ids, mask))
    return items


# ---- capture -----------------------------------------------------------------------------------------

@dataclass
class NormAccumulator:
    """Running sums of per-token L2 norms per captured stream index (keys str(k) and "final")."""
    sums: dict[str, float] = field(default_factory=dict)
    tokens: int = 0

    def means(self) -> dict[str, float]:
        return {k: round(v / max(self.tokens, 1), 4) for k, v in self.sums.items()}


@torch.no_grad()
def capture_samples(target: Target, items: list[tuple[int, torch.Tensor, torch.Tensor]], layout: Layout,
                    store_dtype: torch.dtype, capture_tokens: int, norms: NormAccumulator | None = None,
                    on_batch: Callable[[int, int], None] | None = None) -> list[Sample]:
    """items: (row_id, input_ids [S], loss_mask [S]). Batches by similar length with right padding and an
    attention mask (causal attention: real tokens never see the padding on their right), slices each row's
    real tokens and returns Samples in the order of `items`, features cast to store_dtype on the CPU."""
    dev = target.device
    H = target.hidden_size
    out: list[Sample | None] = [None] * len(items)
    for batch in length_batches([len(it[1]) for it in items], 1 << 30, capture_tokens):
        S = max(len(items[i][1]) for i in batch)
        ids = torch.zeros((len(batch), S), dtype=torch.long)
        am = torch.zeros((len(batch), S), dtype=torch.long)
        for b, i in enumerate(batch):
            ids[b, :len(items[i][1])] = items[i][1]
            am[b, :len(items[i][1])] = 1
        cap = capture(target.model, ids.to(dev), layout, attention_mask=am.to(dev), logits="none")
        real = am.to(dev).bool()  # [B, S]
        # [N, nA*H], [N, H] real tokens only
        _store_batch(items, batch, cap.aux[real], cap.final_prenorm[real], layout, H, store_dtype, norms, out)
        if on_batch:
            on_batch(len(batch), int(am.sum()))
    return [s for s in out if s is not None]


def _store_batch(items: list[tuple[int, torch.Tensor, torch.Tensor]], batch: list[int], aux: torch.Tensor,
                 final: torch.Tensor, layout: Layout, H: int, store_dtype: torch.dtype,
                 norms: NormAccumulator | None, out: list[Sample | None]) -> None:
    """One captured batch (aux [N, nA*H] in layout order, final [N, H], the batch's rows back to back) checked,
    counted into the norms and sliced into Samples at out[i]: shared by eyas's capture and vLLM's."""
    nA = layout.num_aux
    if not (torch.isfinite(aux).all() and torch.isfinite(final).all()):
        raise DatagenError(f"the target produced non-finite hidden states for rows "
                           f"{[items[i][0] for i in batch]}; run it in fp32 (--target-dtype fp32)")
    if norms is not None:
        per = aux.float().view(-1, nA, H).norm(dim=-1).sum(0).tolist()  # [nA]
        for k, v in zip(layout.aux_indices, per, strict=True):
            norms.sums[str(k)] = norms.sums.get(str(k), 0.0) + v
        norms.sums["final"] = norms.sums.get("final", 0.0) + final.float().norm(dim=-1).sum().item()
        norms.tokens += aux.shape[0]
    aux_s, final_s = aux.to(store_dtype).cpu(), final.to(store_dtype).cpu()
    if not (torch.isfinite(aux_s).all() and torch.isfinite(final_s).all()):
        peak = max(aux.abs().max().item(), final.abs().max().item())
        raise DatagenError(f"features overflow the stored dtype {store_dtype} (max |x| = {peak:.0f}; the "
                           "target has massive activations): store them with --dtype bf16 or fp32")
    off = 0
    for i in batch:
        n = len(items[i][1])
        row_id, input_ids, loss_mask = items[i]
        out[i] = Sample(row_id=row_id, input_ids=input_ids, loss_mask=loss_mask,
                        aux=aux_s[off:off + n], final=final_s[off:off + n])
        off += n


# ---- the run -----------------------------------------------------------------------------------------

def _lock(out: Path):
    """An exclusive lock on the folder so two runs never interleave commits; released by the OS on a kill."""
    import fcntl

    f = open(out / ".datagen.lock", "a+")  # noqa: SIM115 (held for the whole run)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.close()
        raise DatagenError(f"another `eyas datagen` is writing into {out}; wait for it or use another --out") from e
    return f


def _refuse_mismatch(out: Path, m: dict[str, Any], layout: Layout, target_source: str,
                     conf: dict[str, Any], template: dict[str, Any]) -> None:
    problems: list[str] = []
    try:
        check_layouts(Layout.from_dict(m["layout"]), layout, f"{out} (existing)", "this run")
    except LayoutError as e:
        problems.append(str(e))
    old = m.get("config", {})
    keys = _IDENTITY_KEYS + (_REGEN_KEYS if conf["regenerate"] or old.get("regenerate") else ())
    diff = [k for k in keys if old.get(k, _LEGACY.get(k)) != conf[k]]
    if diff:
        problems.append("config differs: " + "; ".join(
            f"{k}: existing {old.get(k, _LEGACY.get(k))!r}, this run {conf[k]!r}" for k in diff))
    if not same_template(m.get("chat_template"), template):
        problems.append(f"chat template differs: existing {describe_record(m.get('chat_template'))}, this run "
                        f"{describe_record(template)} ({fix_for(m.get('chat_template'))} to resume)")
    if problems:
        raise DatagenError(
            f"refusing to add to {out}: it was made with different settings (target_source was "
            f"{m.get('target_source')!r}, now {target_source!r}).\n" + "\n".join(problems) +
            "\nfix: rerun with the original settings to resume, or write to a new --out folder")


def _open_manifest(out: Path, cfg: DatagenConfig, target: Target, layout: Layout,
                   conf: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    if (out / MANIFEST).exists():
        try:
            m = load_manifest(out)
        except ShardError as e:
            raise DatagenError(f"{out} holds a {MANIFEST} that is not an eyas shard manifest ({e}); "
                               "use another --out folder") from e
        _refuse_mismatch(out, m, layout, cfg.target, conf, target.chat_template.record())
        m["config"]["num"] = cfg.num  # --num may grow (extends the run) or change; it does not alter content
        for k in ("shard_samples", "shard_tokens", "threads"):  # speed settings only: may change on resume
            m["config"][k] = conf[k]
    else:
        layout.norms = {}
        m = {
            "kind": KIND, "format_version": FORMAT_VERSION, "layout": layout.to_dict(),
            "target_source": cfg.target, "target": target.identity.to_dict(), "config": conf,
            "chat_template": target.chat_template.record(),
            "shards": [], "watermark": cfg.start_row - 1, "complete": False,
            "counts": {}, "skipped": {}, "norm_sums": {}, "norm_tokens": 0, "commands": [], "versions": _versions(),
        }
    m.setdefault("commits", [])  # folders written before commits were recorded have none
    if not m["commits"]:  # a new folder's empty start (or an older folder's state now): a point to roll back to
        m["commits"].append(_commit_state(m))
    m = _redo_damaged(out, m, log)
    listed = {s["file"] for s in m["shards"]}
    for f in sorted(out.glob(SHARD_GLOB)):
        if f.name not in listed:  # committed shard file, uncommitted manifest: the chunk is redone
            log(f"removing {f.name}: written before a kill, never committed to the manifest")
            f.unlink()
    for f in out.glob("*.tmp-*"):
        f.unlink()
    return m


COMMITTED = ("watermark", "counts", "skipped", "norm_sums", "norm_tokens")


def _commit_state(m: dict[str, Any]) -> dict[str, Any]:
    """The manifest's state after a committed chunk (shards listed, rows read, counts): what a resume rolls back
    to when a later shard file is found damaged. Kept in m["commits"], outside the shard entries the dataset
    hash reads."""
    return json.loads(json.dumps({"shards": len(m["shards"]), **{k: m[k] for k in COMMITTED},
                                  "norms": m["layout"].get("norms") or {}}))


def _redo_damaged(out: Path, m: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """Check each listed shard against its entry (size; sha256 where recorded). From the first damaged one on,
    the folder is rolled back to the last commit before it, so this run redoes that chunk (and the ones after;
    their files are then orphans, removed). A folder written before commits were recorded cannot be rolled
    back: one error naming the file."""
    found = next(((i, e, why) for i, e in enumerate(m["shards"]) if (why := damaged(out / e["file"], e))), None)
    if found is None:
        return m
    i, entry, why = found
    earlier = [c for c in m.get("commits") or [] if c["shards"] <= i]
    if not earlier:
        raise DatagenError(f"{out / entry['file']}: {why}; this folder predates the commit records a resume needs "
                           f"to redo one chunk, so delete {out} and rerun datagen")
    c = earlier[-1]
    dropped = len(m["shards"]) - c["shards"]
    log(f"{out / entry['file']}: {why}; rolling back to row {c['watermark']} and redoing the {dropped} shard(s) "
        "from there")
    m["shards"] = m["shards"][:c["shards"]]
    m.update({k: c[k] for k in COMMITTED}, commits=earlier, complete=False)
    m["layout"]["norms"] = c["norms"]
    return m


def _versions() -> dict[str, str]:
    import transformers

    from .. import __version__ as eyas_version
    return {"eyas": eyas_version, "torch": torch.__version__, "transformers": transformers.__version__}


def _counts_view(m: dict[str, Any]) -> dict[str, Any]:
    c = m["counts"]
    secs = c.get("seconds", 0.0)
    return {**c, "tokens_per_s": round(c.get("tokens", 0) / secs, 1) if secs else None,
            "bytes_per_token": round(c.get("bytes", 0) / c["tokens"], 1) if c.get("tokens") else None}


def _chunks(cfg: DatagenConfig, watermark: int, remaining: int | None) -> Iterator[tuple[list[Conversation],
                                                                                        Counter, int, bool]]:
    """(conversations, skipped reasons, last row id covered, source exhausted) per chunk, after the watermark."""
    convs: list[Conversation] = []
    skips: Counter[str] = Counter()
    last = watermark
    if remaining is not None and remaining <= 0:
        return
    for item in self_rows(watermark + 1) if cfg.data == SELF_SOURCE else iter_source(cfg.data):
        if item.row_id <= watermark:
            continue
        if cfg.end_row is not None and item.row_id >= cfg.end_row:
            break  # the rows from here on belong to another folder: this one is complete
        last = item.row_id
        if isinstance(item, Skip):
            skips[item.reason] += 1
            continue
        convs.append(item)
        if remaining is not None:
            remaining -= 1
        if len(convs) >= cfg.shard_samples or remaining == 0:
            yield convs, skips, last, False
            convs, skips = [], Counter()
            if remaining == 0:
                return
    yield convs, skips, last, True


ENGINES = ("eyas", "vllm")
_VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def vllm_engine_args(cfg: DatagenConfig) -> dict[str, Any]:
    """vLLM engine args from --vllm-tp / --vllm-pp and each --vllm-arg KEY=VALUE (VALUE read as JSON when it
    parses, else as a string), passed to vllm.LLM as they are: how a multi-GPU user shards the target."""
    import json

    args: dict[str, Any] = {}
    if cfg.vllm_tp != 1:
        args["tensor_parallel_size"] = cfg.vllm_tp
    if cfg.vllm_pp != 1:
        args["pipeline_parallel_size"] = cfg.vllm_pp
    for item in cfg.vllm_args:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise DatagenError(f"--vllm-arg expects KEY=VALUE (a vllm.LLM engine argument, e.g. "
                               f"gpu_memory_utilization=0.85), got {item!r}")
        try:
            args[key.strip().replace("-", "_")] = json.loads(value)
        except ValueError:
            args[key.strip().replace("-", "_")] = value
    return args


class _LazySession:
    """The vLLM worker, started by the first command sent to it."""

    def __init__(self, start: Callable[[], VllmSession]):
        self.start, self.session = start, None

    def call(self, op: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        if self.session is None:
            self.session = self.start()
        return self.session.call(op, timeout)

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


def _start_vllm(py: Path, cfg: DatagenConfig, target: Target, layout: Layout, out: Path,
                log: Callable[[str], None]) -> VllmSession:
    """Start the vLLM worker on the target's HF folder, capturing the layout's stream indices and the final
    pre-norm state (stream L) through extract_hidden_states; refuses a vLLM whose model differs in shape."""
    if target.path is None:
        raise DatagenError(f"--engine vllm needs the target as a HF folder; {cfg.target} has none")
    work = out / ".vllm"
    for f in (work / "hidden-states").glob("*"):  # a killed run's leftovers
        f.unlink()
    req = {"model": str(target.path), "dtype": _VLLM_DTYPES[cfg.target_dtype],
           "max_model_len": cfg.max_len + 16,  # a row of max_len tokens still gets its one generated token
           "aux_ids": aux_ids(layout.aux_indices, target.num_layers), "seed": cfg.seed,
           "generator": cfg.vllm_generator, "engine_args": vllm_engine_args(cfg)}
    log(f"starting vLLM ({py}) on {target.path} with eagle_aux_hidden_state_layer_ids {req['aux_ids']} "
        "(= eyas stream indices; the last is the final pre-norm state)")
    session = VllmSession(py, req, work, log=lambda line: None)
    info = session.info
    if (info["num_layers"], info["hidden_size"]) != (target.num_layers, target.hidden_size):
        session.close()
        raise DatagenError(f"vLLM loaded a model of {info['num_layers']} layers x {info['hidden_size']}, eyas's "
                           f"target has {target.num_layers} x {target.hidden_size}: pass the same model to both")
    log(f"vLLM {info['vllm']} ready on {info['device']} in {info['load_seconds']} s (replies on a "
        f"{info['generator']} engine)")
    return session


@torch.no_grad()
def capture_samples_vllm(session: VllmSession, items: list[tuple[int, torch.Tensor, torch.Tensor]],
                         layout: Layout, num_layers: int, hidden: int, store_dtype: torch.dtype, capture_tokens: int,
                         work: Path, norms: NormAccumulator | None = None,
                         on_batch: Callable[[int, int], None] | None = None) -> list[Sample]:
    """capture_samples through vLLM: each batch of at most capture_tokens tokens is prefilled by the worker,
    whose extract_hidden_states connector returns every position's states at aux_ids (ascending); they are put
    in the layout's order (aux) and stream L (final), then checked and stored exactly as eyas's own capture."""
    from safetensors.torch import load_file

    ids = aux_ids(layout.aux_indices, num_layers)
    pick = [ids.index(k) for k in layout.aux_indices]
    out: list[Sample | None] = [None] * len(items)
    for batch in length_batches([len(it[1]) for it in items], 1 << 30, capture_tokens):
        file = work / "capture.safetensors"
        r = session.call({"op": "capture", "rows": [items[i][1].tolist() for i in batch], "file": str(file)})
        t = load_file(r["file"])
        file.unlink()
        hs = t["hidden_states"]  # [N, len(ids), H]
        if hs.shape[1:] != (len(ids), hidden) or t["lengths"].tolist() != [len(items[i][1]) for i in batch]:
            raise VllmError(f"the vLLM worker returned states of shape {tuple(hs.shape)} for rows of lengths "
                            f"{t['lengths'].tolist()}; expected [tokens, {len(ids)}, {hidden}] for "
                            f"{[len(items[i][1]) for i in batch]}")
        aux = hs[:, pick].reshape(hs.shape[0], -1)
        final = hs[:, ids.index(num_layers)]
        _store_batch(items, batch, aux, final, layout, hidden, store_dtype, norms, out)
        if on_batch:
            on_batch(len(batch), int(hs.shape[0]))
    return [s for s in out if s is not None]


def run_datagen(cfg: DatagenConfig, command: str | None = None, log: Callable[[str], None] = print,
                progress: bool = True, target: Target | None = None) -> dict[str, Any]:
    """Run (or resume) a datagen job into cfg.out; returns the final manifest (with derived rates)."""
    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    # everything a bad flag or file can fail on comes before --out is created: a failed first run leaves nothing
    source, source_fp = _source_identity(cfg.data)
    choice = cfg.template()
    py = vllm_python(cfg.vllm_python, "datagen --engine vllm") if cfg.engine == "vllm" else None
    if target is None:
        require_template(cfg.target, choice)  # a base model without a template: say what to pass, before loading
        # vLLM runs the target, so eyas needs its tokenizer, config and identity only (no weights: it may not fit)
        target = load_target(cfg.target, dtype=cfg.target_dtype, device=cfg.device, load_weights=py is None)
    use_template(target, choice)
    if cfg.data == SELF_SOURCE:
        try:
            user_turn_opening(target.tokenizer)
        except (ValueError, DataError) as e:
            raise DatagenError(f"--data self: {e}") from e
    try:
        layout = target.default_layout(cfg.aux_indices)
    except LayoutError as e:
        raise DatagenError(f"--aux-indices {cfg.aux_indices}: {e}") from e
    conf = _manifest_config(cfg, source, source_fp)
    if cfg.regenerate:  # what wrote the replies: hf-generate, eyas-fp32, eyas-native (--regen-weights) or vllm
        conf["regen_engine"] = "vllm" if py else regen_numerics(regen_engine(target, cfg.regen_weights))
    out.mkdir(parents=True, exist_ok=True)
    lock = _lock(out)
    try:
        m = _open_manifest(out, cfg, target, layout, conf, log)
        m["config"]["regen_engine"] = conf.get("regen_engine")
        m["commands"].append(command or " ".join(sys.argv))
        atomic_write_json(out / MANIFEST, m)
        if py is not None:  # started at the first chunk with work: a finished folder costs no vLLM start
            def start() -> VllmSession:
                session = _start_vllm(py, cfg, target, layout, out, log)
                m["config"]["vllm"] = {"version": vllm_version(py), "python": str(py),
                                       "device": session.info["device"], "generator": session.info["generator"],
                                       "aux_ids": aux_ids(layout.aux_indices, target.num_layers),
                                       "engine_args": vllm_engine_args(cfg)}  # speed settings: may change
                return session
            cfg.vllm_session = _LazySession(start)
        try:
            _run_chunks(cfg, target, layout, m, out, log, progress)
        finally:
            if cfg.vllm_session is not None:
                cfg.vllm_session.close()
                cfg.vllm_session = None
        if not m["counts"].get("samples"):  # the whole run so far, so a resumed run with samples passes
            rows = m["counts"].get("rows", 0)
            raise DatagenError(f"no samples: all {rows} source rows read from {cfg.data} were skipped "
                               f"({skip_summary(m['skipped'])}); {out} holds nothing to train on" if rows else
                               f"no samples: no rows of {cfg.data} were read (--num {cfg.num}); pass --num N >= 1")
        return {**m, "counts": _counts_view(m)}
    finally:
        lock.close()


def _run_chunks(cfg: DatagenConfig, target: Target, layout: Layout, m: dict[str, Any], out: Path,
                log: Callable[[str], None], progress: bool) -> None:
    from tqdm import tqdm

    counts: Counter[str] = Counter(m["counts"])
    skipped: Counter[str] = Counter(m["skipped"])
    norms = NormAccumulator(dict(m["norm_sums"]), int(m["norm_tokens"]))
    store_dtype = parse_dtype(cfg.dtype)
    done_convs = counts["conversations"]
    remaining = None if cfg.num is None else cfg.num - done_convs
    if remaining is not None and remaining <= 0:
        log(f"{out} already holds {done_convs} conversations (>= --num {cfg.num}); nothing to do")
        m["complete"] = True
        atomic_write_json(out / MANIFEST, m)
        return
    bar = tqdm(total=cfg.num, initial=done_convs, unit="conv", disable=not progress, dynamic_ncols=True,
               desc="datagen", file=sys.stderr)
    m["complete"] = False
    run_t0, run_tokens, base_tokens = time.perf_counter(), 0, counts["tokens"]

    def postfix(phase: str) -> None:  # tokens captured so far (committed or not) and this run's rate
        dt = time.perf_counter() - run_t0
        bar.set_postfix_str(f"{phase} | {base_tokens + run_tokens} tok | {run_tokens / max(dt, 1e-9):.0f} tok/s",
                            refresh=True)

    # the bar is closed (its line ended) on every exit, so an error message starts on a line of its own
    try:
        for convs, skips, last_row, exhausted in _chunks(cfg, int(m["watermark"]), remaining):
            t0 = time.perf_counter()
            stats: Counter[str] = Counter()
            loader_rows = sum(skips.values()) + len(convs)  # source rows this chunk covers
            if cfg.raw:
                items = _raw_items(target, convs, cfg, stats, skips, postfix)
                convs_chat: list[Conversation] = []
            else:
                convs_chat = [c for c in convs if c.text is None]
                if len(convs_chat) < len(convs):  # {"text"} document rows have no chat to render
                    skips["text_row_needs_raw"] += len(convs) - len(convs_chat)
                convs_chat = [Conversation(c.row_id, limit_turns(c.messages, cfg.max_turns), c.dropped_turns)
                              for c in convs_chat]
                if cfg.data == SELF_SOURCE:
                    convs_chat = sample_user_turns(target, convs_chat, cfg, stats, skips, postfix)
                items = []
            if cfg.regenerate and convs_chat:
                convs_chat = regenerate(target, convs_chat, cfg, stats,
                                        lambda lens: length_batches(lens, cfg.gen_batch, cfg.gen_tokens), postfix)
            for c in convs_chat:
                try:
                    ids, mask, exact = tokenize_conversation_checked(target.tokenizer, c.messages)
                except DataError:
                    skips["template_error"] += 1
                    continue
                stats["mask_boundary_inexact"] += int(not exact)
                stats["truncated"] += int(len(ids) > cfg.max_len)
                stats["dropped_leading_assistant"] += int(c.dropped_turns > 0)
                ids, mask = ids[:cfg.max_len], mask[:cfg.max_len]
                if not mask.any():
                    skips["no_loss_tokens_after_truncation"] += 1
                    continue
                items.append((c.row_id, ids, mask))
            postfix("capture")

            def on_batch(n_samples: int, n_tokens: int) -> None:
                nonlocal run_tokens
                run_tokens += n_tokens
                bar.update(n_samples)
                postfix("capture")

            if cfg.vllm_session is not None:
                samples = capture_samples_vllm(cfg.vllm_session, items, layout, target.num_layers,
                                               target.hidden_size, store_dtype, cfg.capture_tokens, out / ".vllm",
                                               norms, on_batch)
            else:
                samples = capture_samples(target, items, layout, store_dtype, cfg.capture_tokens, norms, on_batch)
            bar.update(len(convs) - len(samples))  # conversations skipped after loading still count as processed
            # shards hold samples in source order, split so none exceeds shard_tokens
            entries, group, group_tokens = [], [], 0
            for s in sorted(samples, key=lambda s: s.row_id):
                if group and group_tokens + len(s) > cfg.shard_tokens:
                    entries.append(write_shard(out / f"shard-{len(m['shards']) + len(entries):05d}.safetensors",
                                               group, store_dtype))
                    group, group_tokens = [], 0
                group.append(s)
                group_tokens += len(s)
            if group:
                entries.append(write_shard(out / f"shard-{len(m['shards']) + len(entries):05d}.safetensors",
                                           group, store_dtype))
            # commit: every row up to last_row is now in a shard or counted as skipped
            m["shards"].extend(entries)
            counts.update(stats)
            counts["rows"] += loader_rows
            counts["conversations"] += len(convs)
            counts["samples"] += len(samples)
            counts["tokens"] += sum(len(s) for s in samples)
            counts["loss_tokens"] += sum(int(s.loss_mask.sum()) for s in samples)
            counts["bytes"] += sum(e["bytes"] for e in entries)
            counts["seconds"] = round(counts["seconds"] + time.perf_counter() - t0, 3)
            skipped.update(skips)
            layout.norms = norms.means()
            m.update(watermark=last_row, counts=dict(counts), skipped=dict(skipped), norm_sums=norms.sums,
                     norm_tokens=norms.tokens, layout=layout.to_dict(),
                     complete=exhausted or (cfg.num is not None and counts["conversations"] >= cfg.num))
            m["commits"].append(_commit_state(m))
            atomic_write_json(out / MANIFEST, m)
    finally:
        bar.close()
    if not m["complete"]:  # the source ended exactly at a chunk boundary
        m["complete"] = True
        atomic_write_json(out / MANIFEST, m)


def summary(m: dict[str, Any]) -> list[str]:
    """End-of-run lines: samples, tokens, loss tokens, skipped by reason, bytes per token, size, tokens/s."""
    c = _counts_view(m) if "tokens_per_s" not in m["counts"] else m["counts"]
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(m["skipped"].items(), key=lambda kv: -kv[1])) or "none"
    size = c.get("bytes", 0)
    lines = [
        f"layout: stream indices {m['layout']['aux_indices']} (+ final pre-norm) of {m['target_source']} "
        f"[{m['layout']['target']['fingerprint']}]",
        f"samples {c.get('samples', 0)} from {c.get('conversations', 0)} conversations "
        f"({c.get('rows', 0)} source rows read, complete: {m['complete']})",
        f"tokens {c.get('tokens', 0)}, loss tokens {c.get('loss_tokens', 0)}, "
        f"truncated samples {c.get('truncated', 0)}",
        f"skipped: {skipped}",
        f"size on disk {size / 2**20:.1f} MiB in {len(m['shards'])} shards, "
        f"{c.get('bytes_per_token') or 0:.0f} bytes/token ({m['config']['dtype']})",
        f"throughput {c.get('tokens_per_s') or 0:.0f} tokens/s over {c.get('seconds', 0):.0f} s of processing",
    ]
    if m["config"]["regenerate"]:
        lines.append(
            f"regenerated {c.get('regenerated_replies', 0)} replies, {c.get('regenerated_tokens', 0)} tokens "
            f"({c.get('regenerated_tokens', 0) / max(c.get('regen_ms', 0) / 1000, 1e-9):.0f} tok/s); finished by "
            f"eos {c.get('finish_eos', 0)}, repetition {c.get('finish_repetition', 0)}, "
            f"length {c.get('finish_length', 0)}")
    lines.append(f"norms (mean L2 per token): {m['layout']['norms']}")
    return lines

