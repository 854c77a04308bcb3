"""`eyas doctor flags`: lint an SGLang launch command, a `vllm serve` command or a vLLM
`--speculative-config` JSON against an EAGLE-3 draft folder, and print the corrected command.

Aux-layer ids never travel in flags: both engines read them from the draft folder's config.json (SGLang only
`eagle_config.eagle_aux_hidden_state_layer_ids`, vLLM the top-level list; see eyas/conventions.py). vLLM's
`eagle_aux_layer_semantics` may come from either the config or --speculative-config.
So the lint reads that file exactly as each engine does (`engine_views`) and compares what the
engine will capture with the layout the draft was trained on (the eyas manifest). Every rule is a
fact read in the engines' code; the file is cited at each rule. Pure parsing: no model is loaded.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..conventions import SEMANTICS_KEY
from ..engines import ENGINE_NAMES, EngineRow, engine_row
from .checklist import Check, render_checks, render_fixes
from .draft_dir import DraftInfo, launch_target_arch, path_check, read_draft_dir
from .installed import installed_check, installed_source
from .launch_command import (
    SGLANG_AUTO_PARAMS,
    SGLANG_OPTIONS,
    FlagsError,
    ServeCommand,
    int_option,
    parse_serve_command,
)
from .traps import ids_check, norm_check, residual_check, size_check, vllm_spec_checks, vocab_map_check, weights_check


@dataclass
class FlagLint:
    engine: str
    checks: list[Check]
    corrected: list[str]  # the corrected command (argv), or [json] for a bare speculative config
    config_edits: list[str]  # config.json edits the command cannot carry

    @property
    def ok(self) -> bool:
        return all(c.status in ("pass", "skip") for c in self.checks)

    def corrected_text(self) -> str:
        if len(self.corrected) == 1 and self.corrected[0].startswith("{"):
            return self.corrected[0]
        return " ".join(shlex.quote(a) for a in self.corrected)

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "ok": self.ok, "checks": [c.to_dict() for c in self.checks],
                "corrected": self.corrected_text(), "config_edits": self.config_edits}


def _set_opt(argv: list[str], spellings: list[str], canonical: str, value: str) -> list[str]:
    """Replace the value of an option (any of its spellings, `--x v` or `--x=v`), or append it."""
    out = list(argv)
    for i, a in enumerate(out):
        name, eq, _ = a.partition("=")
        if name in spellings:
            if eq:
                out[i] = f"{canonical}={value}"
            else:
                out[i] = canonical
                if i + 1 < len(out):
                    out[i + 1] = value
                else:
                    out.append(value)
            return out
    return out + [canonical, value]


def lint_serve_command(argv: list[str], draft_dir: str | Path, num_layers: int | None = None,
                       engine: str | None = None, engine_version: str | None = None) -> FlagLint:
    """engine: the engine the command is for (checked against the command); engine_version: the version it runs
    (default: the one the export targets, else the newest in eyas/engines.py, said in the first check)."""
    cmd = parse_serve_command(argv)
    if engine is not None and engine not in ENGINE_NAMES:
        raise FlagsError(f"--engine {engine!r}: expected one of {', '.join(ENGINE_NAMES)}")
    if engine is not None and engine != cmd.engine:
        raise FlagsError(f"--engine {engine} but the command starts {cmd.engine}: pass the {engine} launch command, "
                         f"or --engine {cmd.engine}")
    info = read_draft_dir(draft_dir, num_layers, FlagsError)
    installed = installed_source(cmd.engine)  # its own files decide over the table (eyas/doctor/installed.py)
    try:
        choice = engine_row(cmd.engine, engine_version, (info.engine_versions or {}).get(cmd.engine),
                            installed.version if installed else None)
    except ValueError as e:
        raise FlagsError(f"--engine-version: {e}") from e
    head = [Check("engine_version", "pass", choice.why, numbers={"row": choice.row.label(),
                                                                 "source": choice.row.source})]
    # the target's model class picks SGLang's id rule (eyas/aux_rules.py): the launch's --model-path folder first
    note = launch_target_arch(info, cmd.opts.get("model"))
    head += [Check("target", "warn", note)] if note else []
    src_check, info.aux_rules = installed_check(cmd.engine, installed if engine_version is None or (
        installed and installed.version == engine_version) else None, info.target_arch,
        choice.row.versions.split(" ")[0])
    lint = _lint_sglang(cmd, info, choice.row) if cmd.engine == "sglang" else _lint_vllm(cmd, info, choice.row)
    lint.checks[:0] = head + [src_check]
    return lint


def _folder_checks(info: DraftInfo, row: EngineRow, semantics: str | None = None) -> tuple[list[Check], list[str]]:
    """What the engine version makes of the folder: sizes, weight names, fusion norms, aux states."""
    reads_sem = None if row.engine != "vllm" else SEMANTICS_KEY not in row.ignores
    ids, edit = ids_check(info, row.engine, semantics, reads_sem, info.aux_rules or row.versions.split(" ")[0])
    checks = [size_check(info, row), weights_check(info, row), vocab_map_check(info), norm_check(info, row),
              residual_check(info, row)]
    edits = [c.fix for c in checks if c.status == "fail" and c.fix.startswith("set ")]  # config.json edits
    return checks + [ids], edits + ([edit] if edit else [])


def _temperature(argv: list[str]) -> float | None:
    """A temperature the launch sets for every request (vLLM --override-generation-config), if any."""
    for i, a in enumerate(argv):
        name, eq, val = a.partition("=")
        if name.replace("_", "-") == "--override-generation-config":
            val = val if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            try:
                t = json.loads(val).get("temperature")
            except (json.JSONDecodeError, AttributeError):
                return None
            return float(t) if isinstance(t, int | float) else None
    return None


def _spellings(cmd: ServeCommand, key: str) -> list[str]:
    return [s for s, k in SGLANG_OPTIONS.items() if k == key] + [cmd.spellings.get(key, "")]


def _lint_sglang(cmd: ServeCommand, info: DraftInfo, row: EngineRow) -> FlagLint:
    checks: list[Check] = []
    argv = list(cmd.argv)
    for note in cmd.notes:  # not n: n is an int below (SGLANG_AUTO_PARAMS)
        checks.append(Check("option_spelling", "warn", note, fix="use the full option names (corrected command)"))
    # canonicalise abbreviations in the corrected command
    for key, used in cmd.spellings.items():
        full = next(s for s, k in SGLANG_OPTIONS.items() if k == key)
        if used != full and key != "model":
            argv = [full + a[len(used):] if a == used or a.startswith(used + "=") else a for a in argv]

    # 1. algorithm. sglang/srt/speculative/eagle_worker.py: only EAGLE3 calls the target's
    # set_eagle3_layers_to_capture; with EAGLE the draft gets the target's final (post-norm) 1xH state,
    # and llama_eagle3.py skips fc when the width equals hidden_size, so it runs on the wrong input silently.
    algo = (cmd.opts.get("algorithm") or "").upper()
    if info.is_eagle3:
        if algo == "EAGLE3":
            checks.append(Check("algorithm", "pass", "--speculative-algorithm EAGLE3 for an EAGLE-3 draft"))
        else:
            what = f"--speculative-algorithm {algo}" if algo else "no --speculative-algorithm (no speculation)"
            checks.append(Check(
                "algorithm", "fail",
                f"{what} for an EAGLE-3 draft: only EAGLE3 turns on aux hidden-state capture; "
                + ("with EAGLE the draft silently gets the final 1xH state instead of the "
                   f"{len(info.layout or [0, 0, 0])}xH concatenation and acceptance collapses" if algo == "EAGLE"
                   else "the draft is not used as an EAGLE-3 head"),
                numbers={"algorithm": algo or None}, fix="--speculative-algorithm EAGLE3"))
            argv = _set_opt(argv, _spellings(cmd, "algorithm"), "--speculative-algorithm", "EAGLE3")
    # 2. steps/topk/draft tokens. sglang/srt/server_args.py _handle_speculative_decoding: with none given,
    # auto_choose_speculative_params picks (5, 4, 8); steps missing while topk/draft tokens are given is an
    # assertion; with topk == 1, num_draft_tokens != steps + 1 is rewritten to steps + 1 with only a warning.
    steps, topk, ntok = int_option(cmd, "steps"), int_option(cmd, "topk"), int_option(cmd, "draft_tokens")
    nums = {"steps": steps, "topk": topk, "draft_tokens": ntok}
    if steps is None and topk is None and ntok is None:
        s, k, n = SGLANG_AUTO_PARAMS
        checks.append(Check("draft_shape", "warn", f"no --speculative-num-steps/--speculative-eagle-topk/"
                            f"--speculative-num-draft-tokens: SGLang picks ({s}, {k}, {n}) by target architecture "
                            "(auto_choose_speculative_params); measure and set them", numbers=nums,
                            fix=f"--speculative-num-steps {s} --speculative-eagle-topk {k} "
                                f"--speculative-num-draft-tokens {n} (then tune)"))
    elif steps is None:
        checks.append(Check("draft_shape", "fail", "--speculative-eagle-topk/--speculative-num-draft-tokens given "
                            "without --speculative-num-steps: SGLang asserts all three are unset when steps is "
                            "unset (server_args.py)", numbers=nums, fix="add --speculative-num-steps"))
    elif topk == 1 and ntok is not None and ntok != steps + 1:
        checks.append(Check(
            "draft_shape", "fail",
            f"--speculative-eagle-topk 1 with --speculative-num-draft-tokens {ntok} != steps + 1 = {steps + 1}: "
            f"SGLang silently rewrites num_draft_tokens to {steps + 1} (only a log warning), so the server "
            f"verifies {steps + 1} tokens, not {ntok}", numbers=nums,
            fix=f"--speculative-num-draft-tokens {steps + 1} (what SGLang runs), or --speculative-num-steps "
                f"{ntok - 1} for a chain of {ntok - 1} drafted tokens"))
        argv = _set_opt(argv, _spellings(cmd, "draft_tokens"), "--speculative-num-draft-tokens", str(steps + 1))
    elif topk is not None and ntok is not None and ntok - 1 > topk + (steps - 1) * topk * topk:
        # sglang/srt/speculative/eagle_utils.py organize_draft_results: top (num_draft_tokens - 1) of the
        # topk + (steps - 1) * topk^2 scored candidates, plus the root
        most = 1 + topk + (steps - 1) * topk * topk
        checks.append(Check("draft_shape", "fail", f"--speculative-num-draft-tokens {ntok} exceeds the {most} nodes "
                            f"a tree of {steps} steps and top-k {topk} can hold", numbers=nums,
                            fix=f"--speculative-num-draft-tokens {most} or fewer"))
    else:
        checks.append(Check("draft_shape", "pass", f"steps {steps}, topk {topk}, draft tokens {ntok}: consistent",
                            numbers=nums))
    # 3. draft path vs the folder linted
    path_check(checks, cmd.opts.get("draft_path"), info, "--speculative-draft-model-path")
    # 4. the folder as this SGLang version loads it: sizes, weight names, fusion norms, aux ids (eyas/engines.py)
    folder, edits = _folder_checks(info, row)
    return FlagLint("sglang", checks + folder, argv, edits)


def _lint_vllm(cmd: ServeCommand, info: DraftInfo, row: EngineRow) -> FlagLint:
    checks: list[Check] = []
    spec = dict(cmd.spec_config or {})
    if cmd.spec_config is None:
        checks.append(Check("speculative_config", "fail", "no --speculative-config: vLLM runs without speculation",
                            fix=f"--speculative-config '{{\"method\": \"eagle3\", \"model\": \"{info.path}\", "
                                "\"num_speculative_tokens\": 3}'"))
        spec = {"model": str(info.path), "num_speculative_tokens": 3}
    # 1. method. vllm/config/speculative.py SpeculativeConfig.__post_init__: without "method" the method
    # is guessed from the model path: "eagle-" in the lower-cased path -> "eagle" (EAGLE-1: no aux capture),
    # then "eagle3" -> "eagle3", otherwise a plain draft model. Only "eagle3" turns on aux capture. vLLM 0.32
    # first sets a missing method to "draft_model" and then applies the path guess, so an explicit
    # "draft_model" is guessed from the path the same way.
    method = spec.get("method")
    model = str(spec.get("model") or "")
    if info.is_eagle3:
        if method == "eagle3":
            checks.append(Check("method", "pass", 'method "eagle3" set explicitly'))
        else:
            if method in (None, "draft_model"):
                low = model.lower()
                guess = "eagle" if "eagle-" in low else "eagle3" if "eagle3" in low else "draft_model"
                status = "warn" if guess == "eagle3" else "fail"
                said = 'no "method"' if method is None else 'method "draft_model"'
                summary = f'{said}: vLLM guesses it from the model path {model!r} -> "{guess}"'
                if guess == "eagle3":
                    summary += "; set it explicitly — renaming the folder changes the method"
                elif guess == "draft_model":
                    # vllm/v1/spec_decode/draft_model.py DraftModelProposer: pass_hidden_states_to_model=False,
                    # so the Eagle3 head's forward never gets the target's hidden states it requires
                    summary += (": vLLM loads this EAGLE-3 head as a generic draft model, which is run without the "
                                "target's hidden states — the server starts, then fails on the first request")
                else:
                    summary += ": wrong for an EAGLE-3 draft (no aux capture)"
            else:
                status = "fail"
                summary = (f'method "{method}" for an EAGLE-3 draft: only "eagle3" captures aux hidden states'
                           + ("; with \"eagle\" the draft gets the final 1xH state" if method == "eagle" else ""))
            checks.append(Check("method", status, summary, numbers={"method": method}, fix='"method": "eagle3"'))
            spec["method"] = "eagle3"
    if "num_speculative_tokens" not in spec:
        checks.append(Check("num_speculative_tokens", "warn", "no num_speculative_tokens: vLLM takes it from the "
                            "draft config (n_predict) or refuses to start", fix='"num_speculative_tokens": 3'))
        spec["num_speculative_tokens"] = 3
    path_check(checks, model or None, info, '"model" in --speculative-config')
    if not model:
        spec["model"] = str(info.path)
    spec_checks = vllm_spec_checks(spec, row, _temperature(cmd.argv))
    folder, edits = _folder_checks(info, row, spec.get(SEMANTICS_KEY))
    checks += spec_checks + folder
    for c in spec_checks:  # the corrected command drops what this version refuses, and samples drafts when asked
        if c.name == "speculative_config":
            spec = {k: v for k, v in spec.items() if k not in c.numbers["unknown"]}
        elif c.name == "draft_sampling" and c.status == "warn":
            spec["draft_sample_method"] = "probabilistic"
    new_json = json.dumps(spec)
    if cmd.json_only:
        corrected = [new_json]
    else:
        argv = _drop_dotted(cmd.argv)  # the dotted form is folded into the one JSON
        corrected = _set_opt(argv, [cmd.spellings.get("spec", "--speculative-config"), "--speculative-config",
                                    "--speculative_config"], "--speculative-config", new_json)
    return FlagLint("vllm", checks, corrected, edits)


def _drop_dotted(argv: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        name, eq, _ = a.partition("=")
        if name.replace("_", "-").startswith("--speculative-config."):
            skip = not eq
            continue
        out.append(a)
    return out


def render_lint(lint: FlagLint, console=None) -> None:
    from rich.console import Console

    con = console or Console()
    render_checks(lint.checks, f"eyas doctor flags ({lint.engine})", con)
    render_fixes(lint.checks, con)
    if lint.ok:
        con.print("[green]the command and the draft's config.json agree with the trained draft[/]")
        return
    con.print("corrected command:", style="bold")
    con.print(lint.corrected_text(), markup=False, highlight=False, soft_wrap=True)
    for e in lint.config_edits:
        con.print(f"and in the draft folder: {e}", markup=False, highlight=False)
