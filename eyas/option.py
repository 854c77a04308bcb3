"""A config dataclass field that is also a command-line option: its flag and help live on the field, so the
dataclass is the one source of both (eyas.cli.common.config_options builds the typer options from it)."""

from __future__ import annotations

from dataclasses import field, fields
from typing import Any


def option(flag: str, help: str, default: Any = None) -> Any:
    """A dataclass field offered on the command line as `flag` (with `help`); the CLI's default is the field's."""
    return field(default=default, metadata={"flag": flag, "help": help})


def option_like(config: type, name: str, default: Any) -> Any:
    """A field offered under `config`'s flag and help for its field `name` (one declaration of the option), with
    a default of its own: a pipeline's config reusing a stage's option (eyas recipe's --lr is eyas train's)."""
    f = next(f for f in fields(config) if f.name == name)
    return field(default=default, metadata={"flag": f.metadata["flag"], "help": f.metadata["help"]})


# the help of options many commands and configs share
DEFAULT_TARGET = "smollm2-135m"  # the bundled target every command defaults to (eyas.target.family.BUNDLED)
TARGET_HELP = f"{DEFAULT_TARGET}, a HF model folder, or a .gguf file"
DEVICE_HELP = "cpu | cuda | cuda:N"
DRAFT_HELP = ("eyas draft folder, 'default' (bundled; the default with method tree and chain), 'random' (untrained: "
              "the plumbing, not the speed) or 'none'")
METHOD_HELP = ("tree | chain (EAGLE-3) | lookup (no draft: verify what followed the context's last n-gram before; "
               "--lookup tokens) | plain (no draft). Default: tree, plain with --draft none")
RAW_HELP = ("send --prompt as plain text, without a chat template (base models; the tokenizer's own BOS rule "
            "applies)")
CHAT_TEMPLATE_HELP = ("render chats with this template: a Jinja FILE or a built-in NAME (chatml | gemma | llama3); "
                      "default: the tokenizer's own")
DTYPE_HELP = "fp32 | bf16 | fp16"
WEIGHTS_HELP = ("target forward: native (a GGUF's own quantized weights, 8-bit activations, CPU) | native-bf16 (the "
                "same weights, bf16 activations) | fp32 (the dequantized copy in --dtype) | auto (native where "
                "possible)")
DRAFT_WEIGHTS_HELP = "draft matrices: q8 (8-bit blocks, CPU) | fp32 | auto (q8 with native target weights)"
NGRAM_HELP = ("n-gram table (eyas ngram) proposing where context lookup finds nothing, with method lookup or "
              "--lookup > 0: auto (the bundled one when counted for this target) | default | none | PATH")
