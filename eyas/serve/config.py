"""`eyas serve`'s settings: the server's limits and their flags (eyas.option fields, so the command's options are
these declarations), checked before any model loads."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import EyasError
from ..option import option

API_KEY_ENV = "EYAS_API_KEY"
PREFILL_CHUNK = 256  # prompt tokens per prefill forward (the server's default); a longer prompt is a long one
MAX_LONG_PROMPTS = 8  # long prompts held at once (eyas serve --max-long-prompts); the next gets a 503
# a short request waits about one chunk of a long prompt's prefill for its first token; each chunk is one
# forward, so tiny chunks multiply the long prompt's forwards
MIN_PREFILL_CHUNK = 16


class ServeError(EyasError):
    pass


@dataclass
class ServeConfig:
    model_name: str  # the model id clients send (the command's --model-name, default: the target's name)
    api_key: str | None = None  # resolved from --api-key or $EYAS_API_KEY by the command
    max_prompt_tokens: int = option("--max-prompt-tokens", "longer prompts get a 400", 4096)
    max_new_tokens: int = option("--max-new-tokens", "cap (and default) for max_tokens", 1024)
    context_length: int | None = None  # the target's position limit: prompt + completion must fit
    prefill_chunk: int = option("--prefill-chunk", f"prompt tokens per prefill forward (>= {MIN_PREFILL_CHUNK}; 0 = "
                                "whole prompts): other requests run between a long prompt's chunks, so a short "
                                "request's first token waits about one chunk", PREFILL_CHUNK)
    max_long_prompts: int = option("--max-long-prompts", "prompts longer than one prefill chunk held at once (they "
                                   "interleave chunk by chunk with everything else); the next gets a 503 with "
                                   "Retry-After", MAX_LONG_PROMPTS)

    def check(self) -> None:
        if self.max_prompt_tokens < 1:
            raise ServeError(f"--max-prompt-tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.prefill_chunk != 0 and self.prefill_chunk < MIN_PREFILL_CHUNK:
            raise ServeError(f"--prefill-chunk must be >= {MIN_PREFILL_CHUNK} tokens (or 0: whole prompts), got "
                             f"{self.prefill_chunk}; smaller chunks add a forward per few tokens for no fairness "
                             f"gain. The default is {PREFILL_CHUNK}")
        if self.max_long_prompts < 1:
            raise ServeError(f"--max-long-prompts must be >= 1, got {self.max_long_prompts}; it is how many prompts "
                             f"longer than one prefill chunk the server interleaves at once (default "
                             f"{MAX_LONG_PROMPTS})")
        if self.max_new_tokens < 1:
            raise ServeError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not self.model_name:
            raise ServeError("--model-name must not be empty")
        if self.api_key is not None and not self.api_key.strip():
            raise ServeError(f"the API key (--api-key or ${API_KEY_ENV}) is empty; set a real key or leave it unset")
