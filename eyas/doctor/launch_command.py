"""A serving engine's launch command as eyas reads it: which engine (SGLang's launch_server or `vllm serve`, read
from the program, module or subcommand, never a substring), its speculative options with SGLang's argparse prefix
resolution, and vLLM's --speculative-config (JSON or dotted keys). Pure parsing: `eyas doctor flags` lints what
this returns (eyas/doctor/flags.py), `doctor serving` reads the launch's draft and engine from it."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import EyasError


class FlagsError(EyasError):
    """The command or the draft folder cannot be read; the message says what was expected."""


# SGLang's parser is argparse (sglang/srt/server_args.py ServerArgs.add_cli_args), which also accepts
# unambiguous prefixes (--speculative-algo). The speculative options, for prefix resolution:
SGLANG_OPTIONS = {
    "--speculative-algorithm": "algorithm",
    "--speculative-draft-model-path": "draft_path",
    "--speculative-draft-model-revision": "draft_revision",
    "--speculative-draft-load-format": "draft_load_format",
    "--speculative-draft-attention-backend": "draft_attention_backend",
    "--speculative-num-steps": "steps",
    "--speculative-eagle-topk": "topk",
    "--speculative-num-draft-tokens": "draft_tokens",
    "--speculative-accept-threshold-single": "accept_single",
    "--speculative-accept-threshold-acc": "accept_acc",
    "--speculative-token-map": "token_map",
    "--model-path": "model",
    "--model": "model",  # alias of --model-path
}
# sglang/srt/server_args.py auto_choose_speculative_params: (steps, topk, draft tokens) when none is given
SGLANG_AUTO_PARAMS = (5, 4, 8)


@dataclass
class ServeCommand:
    engine: str  # sglang | vllm
    argv: list[str]
    opts: dict[str, str]  # key -> value as written
    spellings: dict[str, str]  # key -> the option spelling used (for abbreviations)
    spec_config: dict[str, Any] | None = None  # vLLM --speculative-config
    json_only: bool = False  # the input was a bare --speculative-config JSON
    notes: list[str] = field(default_factory=list)


def _resolve_sglang(opt: str) -> tuple[str | None, list[str]]:
    if opt in SGLANG_OPTIONS:
        return opt, [opt]
    matches = [o for o in SGLANG_OPTIONS if o.startswith(opt) and o != "--model"]
    return (matches[0] if len(matches) == 1 else None), matches


def parse_serve_command(argv: list[str]) -> ServeCommand:
    """argv: an SGLang launch command, a vLLM serve command, or one --speculative-config JSON string."""
    if len(argv) == 1 and not argv[0].lstrip().startswith("{"):
        argv = shlex.split(argv[0])  # the whole command given as one quoted string
    if not argv:
        raise FlagsError("no serve command given: pass it after `--`, e.g. `eyas doctor flags --draft D -- "
                         "python -m sglang.launch_server --model-path M --speculative-algorithm EAGLE3 ...`")
    if len(argv) == 1 and argv[0].lstrip().startswith("{"):
        return ServeCommand("vllm", argv, {}, {}, spec_config=_parse_json(argv[0]), json_only=True)
    engine = detect_engine(argv)
    return _parse_sglang(argv) if engine == "sglang" else _parse_vllm(argv)


# launchers put in front of the engine's program: they and their own options are skipped
_WRAPPERS = {"env", "nohup", "exec", "time", "nice", "numactl", "taskset", "stdbuf"}


def _program(argv: list[str]) -> tuple[str, list[str]]:
    """The engine's program name and what follows it, skipping env assignments (`CUDA_VISIBLE_DEVICES=0`)
    and wrappers with their options (`env`, `nohup`, `nice -n 5`, `uv run`). ('', []) when the command
    starts with an option: a bare list of serve options."""
    i = 0
    while i < len(argv):
        a = argv[i]
        name = Path(a).name
        if "=" in a and not a.startswith("-") and a.split("=", 1)[0].isidentifier():
            i += 1  # VAR=value
        elif name in _WRAPPERS or (name == "uv" and argv[i + 1:i + 2] == ["run"]):
            i += 2 if name == "uv" else 1
            while i < len(argv) and (argv[i].startswith("-") or argv[i].isdigit()):
                i += 1  # the wrapper's own options (nice -n 5)
        elif a.startswith("-"):
            return "", []
        else:
            return name, argv[i + 1:]
    return "", []


def detect_engine(argv: list[str]) -> str:
    """'sglang' or 'vllm', from the command's structure: the program it runs (`vllm serve`, `sglang serve`),
    the module after `python -m` (sglang.launch_server, vllm.entrypoints.openai.api_server), or, for a bare
    list of options, which engine's speculative flags it uses. Never from a substring anywhere in the command:
    a path such as /models/exp_sglang inside a vLLM --speculative-config must not make it an SGLang launch."""
    prog, rest = _program(argv)
    if prog.startswith("python") or prog == "py":
        mod = rest[rest.index("-m") + 1] if "-m" in rest and rest.index("-m") + 1 < len(rest) else ""
        root = mod.split(".")[0]
        if root in ("sglang", "vllm"):
            return root
        raise FlagsError(f"`{prog} {' '.join(rest[:3])}` does not start SGLang or vLLM: expected `python -m "
                         "sglang.launch_server ...` or `python -m vllm.entrypoints.openai.api_server ...`")
    if prog in ("sglang", "vllm"):
        return prog
    if prog:
        raise FlagsError(f"cannot tell which engine `{prog}` starts. Expected an SGLang launch (python -m "
                         "sglang.launch_server ...), a vLLM serve command (vllm serve ...), or a "
                         "--speculative-config JSON object")
    # options only (no program): the speculative flags say which engine they belong to
    names = {a.partition("=")[0].replace("_", "-") for a in argv if a.startswith("--")}
    sg = any(n.startswith(("--speculative-algo", "--speculative-eagle", "--speculative-draft",
                           "--speculative-num-")) or n == "--model-path" for n in names)
    vl = any(n.startswith("--speculative-config") for n in names)
    if sg != vl:
        return "sglang" if sg else "vllm"
    what = "both SGLang's and vLLM's speculative options" if sg else "no speculative option"
    raise FlagsError(f"cannot tell which engine these options are for ({what}): {' '.join(argv)[:200]!r}. Give "
                     "the whole command: python -m sglang.launch_server ... or vllm serve ...")


def _parse_json(s: str) -> dict[str, Any]:
    try:
        d = json.loads(s)
    except json.JSONDecodeError as e:
        raise FlagsError(f"--speculative-config is not valid JSON ({e}): {s[:200]!r}. Quote it for the shell: "
                         "--speculative-config '{\"method\": \"eagle3\", ...}'") from e
    if not isinstance(d, dict):
        raise FlagsError(f"--speculative-config must be a JSON object, found {type(d).__name__}")
    return d


def _parse_sglang(argv: list[str]) -> ServeCommand:
    opts: dict[str, str] = {}
    spell: dict[str, str] = {}
    notes: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            name, eq, val = a.partition("=")
            full, matches = _resolve_sglang(name)
            if full is None and len(matches) > 1:
                notes.append(f"`{name}` is an ambiguous abbreviation for SGLang's argparse (matches "
                             f"{', '.join(matches)}); current SGLang refuses it — write the full option")
                full = "--speculative-draft-model-path" if "--speculative-draft-model-path" in matches else None
            if full is not None:
                key = SGLANG_OPTIONS[full]
                if not eq:
                    val = argv[i + 1] if i + 1 < len(argv) else ""
                    i += 1
                opts[key] = val
                spell[key] = name
        i += 1
    return ServeCommand("sglang", list(argv), opts, spell, notes=notes)


def _parse_vllm(argv: list[str]) -> ServeCommand:
    opts: dict[str, str] = {}
    spell: dict[str, str] = {}
    spec: dict[str, Any] | None = None
    dotted: dict[str, Any] = {}
    if "serve" in argv:
        k = argv.index("serve")
        if k + 1 < len(argv) and not argv[k + 1].startswith("-"):
            opts["model"] = argv[k + 1]
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, val = a.partition("=")
        norm = name.replace("_", "-")
        if norm.startswith("--speculative-config"):
            if not eq:
                val = argv[i + 1] if i + 1 < len(argv) else ""
                i += 1
            if norm == "--speculative-config":
                spec = _parse_json(val)
                spell["spec"] = name
            else:  # vLLM also takes --speculative-config.key value
                key = norm[len("--speculative-config."):].replace("-", "_")
                dotted[key] = _scalar(val)
        elif norm == "--model":
            if not eq:
                val = argv[i + 1] if i + 1 < len(argv) else ""
                i += 1
            opts["model"] = val
        i += 1
    if dotted:
        spec = {**(spec or {}), **dotted}
    return ServeCommand("vllm", list(argv), opts, spell, spec_config=spec)


def _scalar(v: str) -> Any:
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def int_option(cmd: ServeCommand, key: str) -> int | None:
    v = cmd.opts.get(key)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError as e:
        raise FlagsError(f"{cmd.spellings.get(key, key)} {v!r}: expected an integer") from e
