"""`eyas datagen`'s options: DatagenConfig and its checks, DatagenError, the skip reasons and their hints."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..engine.weights import WEIGHTS
from ..errors import EyasError
from ..target.device import parse_dtype
from ..target.template import ChatTemplate, resolve_template
from .conversations import SELF_SOURCE

ENGINES = ("eyas", "vllm")

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
    raw: bool = False  # base models: rows as plain text, no template (see raw_items for the loss mask)
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


def vllm_engine_args(cfg: DatagenConfig) -> dict[str, Any]:
    """vLLM engine args from --vllm-tp / --vllm-pp and each --vllm-arg KEY=VALUE (VALUE read as JSON when it
    parses, else as a string), passed to vllm.LLM as they are: how a multi-GPU user shards the target."""
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
