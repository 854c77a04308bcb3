"""`eyas datagen`'s options: DatagenConfig and its checks, DatagenError, the skip reasons and their hints."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..engine.weights import WEIGHTS
from ..errors import EyasError
from ..option import CHAT_TEMPLATE_HELP, DEFAULT_TARGET, DEVICE_HELP, TARGET_HELP, option
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
    "invalid_utf8": "the rows' text is not valid UTF-8 (undecodable bytes or lone surrogate escapes): re-save the "
                    "source as UTF-8",
    "self_prompt_unfinished": "the target's own user turns never reached its end-of-turn token: --data self needs a "
                              "chat-tuned target (or pass a file of conversations as --data)",
    "self_prompt_loop": "the target's own user turns looped: --data self needs a chat-tuned target",
}


# skip reasons whose row ids the shard manifest lists ("skipped_rows"): damaged text a user wants to find and mend,
# where the other reasons are the data's shape; at most LISTED_ROWS ids each (the count in "skipped" stays whole)
LISTED_SKIPS = ("invalid_utf8",)
LISTED_ROWS = 1000


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
    """The options of `eyas datagen`: each field declared with `option` is its flag, help and default."""

    out: str  # shard folder (created; rerunning the same command resumes)
    target: str = option("--target", TARGET_HELP, DEFAULT_TARGET)
    data: str = option("--data", "sharegpt (bundled), a ShareGPT JSON/JSONL or messages JSONL, or self (the target "
                       "writes the user turns too; needs --num or --end-row)", "sharegpt")
    num: int | None = option("--num", "first N usable conversations from --start-row (default: all); more extends a "
                             "run")
    start_row: int = option("--start-row", "skip the source's rows before this one (new conversations for a second "
                            "folder; fixed for the folder)", 0)
    end_row: int | None = option("--end-row", "never read the source's rows from this one on (another folder starts "
                                 "there)")
    max_len: int = option("--max-len", "tokens per sample (longer ones are truncated)", 2048)
    regenerate: bool = option("--regenerate/--no-regenerate", "the target writes the replies", True)
    temperature: float = option("--temperature", "regeneration: 0 = greedy", 0.0)
    top_p: float = option("--top-p", "regeneration: nucleus sampling when --temperature > 0", 1.0)
    seed: int = option("--seed", "regeneration sampling seed", 0)
    max_new_tokens: int = option("--max-new-tokens", "regeneration: tokens per reply", 512)
    max_turns: int | None = option("--max-turns", "keep at most N assistant replies per conversation")
    # a regenerated reply stops once its last n tokens repeat an earlier stretch
    repetition_limit: int = option("--repetition-limit", "stop a regenerated reply once it repeats an N-token loop "
                                   "(0 = off)", 32)
    dtype: str = option("--dtype", "stored feature dtype: bf16 | fp16 | fp32", "bf16")
    target_dtype: str = option("--target-dtype", "dtype the target runs in", "fp32")
    device: str = option("--device", DEVICE_HELP, "cpu")
    aux_indices: list[int] | None = None  # --aux-indices 2,15,27; None = the target's EAGLE-3 default
    shard_samples: int = option("--shard-samples", "conversations per chunk (and at most per shard)", 64)
    shard_tokens: int = option("--shard-tokens", "max tokens per shard (a chunk's samples are split)", 65536)
    gen_batch: int = option("--gen-batch", "regeneration: prompts decoding at once", 64)
    regen_weights: str = option("--regen-weights", "regeneration: the engine's weights, as --weights (auto: native "
                                "for a GGUF on the CPU, the numerics eyas serves with) | fp32 (the HF weights in "
                                "--target-dtype)", "auto")
    gen_tokens: int = 65536  # KV-cache slots for generation (rows x longest prompt + new tokens): bounds memory
    capture_tokens: int = option("--capture-tokens", "padded tokens per capture forward (bounds activation memory)",
                                 8192)
    threads: int = option("--threads", "torch CPU threads (0 = default; 1 on a busy machine)", 0)
    chat_template: str | None = option("--chat-template", CHAT_TEMPLATE_HELP)
    raw: bool = option("--raw", "base models: rows as plain text without a template ({'text'} documents, or a "
                       "conversation's texts joined); loss on every token, or with regeneration on the target's "
                       "continuation", False)
    engine: str = option("--engine", "who runs the target: eyas | vllm (vLLM writes the replies and, through "
                         "extract_hidden_states, the stream states; eyas loads no weights)", "eyas")
    vllm_python: str | None = option("--vllm-python", "--engine vllm: the python of a vLLM environment (default "
                                     "$EYAS_VLLM_PYTHON, then .venv-vllm from `make vllm`)")
    vllm_tp: int = option("--vllm-tp", "--engine vllm: tensor_parallel_size", 1)
    vllm_pp: int = option("--vllm-pp", "--engine vllm: pipeline_parallel_size", 1)
    vllm_args: list[str] = field(default_factory=list)  # --vllm-arg KEY=VALUE (VALUE read as JSON), repeatable
    vllm_generator: str = option("--vllm-generator", "--engine vllm: the replies on the capture engine (shared: one "
                                 "copy of the weights) or a second plain one (separate: faster decoding); auto = "
                                 "separate on the CPU, shared on CUDA", "auto")
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
