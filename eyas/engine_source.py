"""Facts read from an engine's own code: where its aux-layer id rule lives for a target architecture, which draft
config keys its EAGLE-3 loaders read, and the per-request counts it returns.

eyas's tables (eyas/aux_rules.py, eyas/engines.py) say what each release does; this module reads the same facts
from an installed engine or a downloaded wheel, so a test can hold the tables to the engine's code and
`doctor flags`/`export` can prefer the installed engine over the table. The engine's code is read, and the one
function that maps ids (SGLang `set_eagle3_layers_to_capture`, vLLM `set_aux_hidden_state_layers` and
`_get_eagle3_aux_layers_from_config`) is run on a stand-in object with the ids: nothing of the engine is
imported, nothing of it is copied into eyas.
"""

from __future__ import annotations

import ast
import logging
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .errors import EyasError

PACKAGES = {"sglang": "sglang", "vllm": "vllm"}
MODELS_DIR = {"sglang": "sglang/srt/models", "vllm": "vllm/model_executor/models"}
# wrappers whose rule is their language model's (the wrapper's method calls language_model's); the inner class is
# what the wrapper's own file builds for the text model (checked in the test against the file's text)
WRAPS = {
    "KimiK25ForConditionalGeneration": "DeepseekV3ForCausalLM",
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Llama4ForConditionalGeneration": "Llama4ForCausalLM",
}


class SourceError(EyasError):
    """An engine's source cannot be found or read; the message says where eyas looked."""


@dataclass
class Source:
    """One release's Python files: an unpacked package folder (site-packages) or a wheel, read as text."""

    engine: str
    version: str
    where: str  # the folder or the wheel
    _zip: zipfile.ZipFile | None = None
    _cache: dict[str, str | None] = field(default_factory=dict)
    _names: list[str] | None = None

    def read(self, rel: str) -> str | None:
        """The text of a file by its path inside the package root (e.g. sglang/srt/models/llama.py)."""
        if rel not in self._cache:
            text = None
            try:
                if self._zip is not None:
                    text = self._zip.read(rel).decode("utf-8")
                elif (Path(self.where) / rel).is_file():
                    text = (Path(self.where) / rel).read_text(encoding="utf-8")
            except (KeyError, OSError, UnicodeDecodeError):
                text = None
            self._cache[rel] = text
        return self._cache[rel]

    def names(self, folder: str) -> list[str]:
        """The .py files directly inside `folder` (a path inside the package root)."""
        if self._names is None:
            if self._zip is not None:
                self._names = self._zip.namelist()
            else:
                root = Path(self.where)
                self._names = [str(p.relative_to(root)) for p in (root / folder).glob("*.py")]
        pre = folder.rstrip("/") + "/"
        return sorted(n for n in self._names if n.startswith(pre) and "/" not in n[len(pre):] and n.endswith(".py"))

    def label(self) -> str:
        return f"{self.engine} {self.version} ({self.where})"


def open_source(path: str | Path, engine: str) -> Source:
    """A wheel (.whl) or a folder holding the engine's package (site-packages, or an unpacked wheel)."""
    p = Path(path)
    pkg = PACKAGES[engine]
    if p.is_file() and p.suffix == ".whl":
        try:
            z = zipfile.ZipFile(p)
        except zipfile.BadZipFile as e:
            raise SourceError(f"{p} is not a readable wheel ({e}); download it again") from e
        m = re.match(rf"{pkg}(?:_cpu)?-([^-]+)-", p.name)
        return Source(engine, m.group(1) if m else "?", str(p), z)
    if p.is_dir() and p.name == pkg:
        p = p.parent
    if not (p / pkg).is_dir():
        raise SourceError(f"{path}: expected a {engine} wheel or a folder holding the {pkg}/ package")
    return Source(engine, _installed_version(p, pkg), str(p))


def _installed_version(site: Path, pkg: str) -> str:
    for meta in sorted(site.glob(f"{pkg}*.dist-info/METADATA")):
        for line in meta.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip().split("+")[0]
    return "?"


def cache_dir() -> Path:
    from .files import cache_dir as eyas_cache

    return eyas_cache() / "engines"


def find_source(engine: str, version: str | None = None, python: str | None = None) -> Source | None:
    """The engine's code where eyas can read it, or None: $EYAS_SGLANG_SOURCE / $EYAS_VLLM_SOURCE (a wheel or a
    folder), the engine's `python` (the caller finds vLLM's venv), this python, then a wheel of `version` in eyas's
    cache. A found release other than `version` is returned all the same (the caller says which it read)."""
    env = os.environ.get(f"EYAS_{engine.upper()}_SOURCE")
    if env:
        return open_source(env, engine)
    if python:
        site = _site_of(python, PACKAGES[engine])
        if site is not None:
            return open_source(site, engine)
    import importlib.util

    spec = importlib.util.find_spec(PACKAGES[engine]) if engine == "sglang" else None
    if spec is not None and spec.submodule_search_locations:
        return open_source(Path(list(spec.submodule_search_locations)[0]).parent, engine)
    if version:
        for whl in sorted(cache_dir().glob(f"{PACKAGES[engine]}-{version}-*.whl")):
            return open_source(whl, engine)
    return None


def _site_of(python: str, pkg: str) -> Path | None:
    """The folder holding `pkg` for another interpreter, found without importing the package."""
    code = (f"import importlib.util as u; s = u.find_spec({pkg!r}); "
            "print(s.submodule_search_locations[0] if s and s.submodule_search_locations else '')")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return Path(out).parent if out else None


def download_wheel(engine: str, version: str, dest: Path | None = None) -> Path:
    """pip download --no-deps the release's wheel into eyas's cache (the package registry is reachable from CI)."""
    dest = dest or cache_dir()
    dest.mkdir(parents=True, exist_ok=True)
    pkg = PACKAGES[engine]
    for whl in sorted(dest.glob(f"{pkg}-{version}-*.whl")):
        return whl
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q", "-d", str(dest),
           f"{pkg}=={version}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    found = sorted(dest.glob(f"{pkg}-{version}-*.whl"))
    if r.returncode != 0 or not found:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SourceError(f"pip download {pkg}=={version} failed ({tail[0][:200]}); download it by hand and set "
                          f"$EYAS_{engine.upper()}_SOURCE to the wheel")
    return found[0]


# ---- classes and methods, read from the files ------------------------------------------------------

@dataclass
class ClassInfo:
    name: str
    file: str
    node: ast.ClassDef
    imports: dict[str, str]  # name -> module it was imported from (in this class's file)


_PARSED: dict[tuple[str, str], ast.Module | None] = {}


def _parse(src: Source, rel: str) -> ast.Module | None:
    key = (src.where, rel)
    if key not in _PARSED:
        text = src.read(rel)
        try:
            _PARSED[key] = None if text is None else ast.parse(text)
        except SyntaxError:
            _PARSED[key] = None
    return _PARSED[key]


def find_class(src: Source, name: str, hint: str | None = None) -> ClassInfo | None:
    """The class `name` in the engine's model files: first in `hint` (a file path inside the package root), then
    any model file whose text defines it."""
    folder = MODELS_DIR[src.engine]
    files = ([hint] if hint else []) + [f for f in src.names(folder) if f != hint]
    pat = re.compile(rf"^class {re.escape(name)}\b", re.M)
    for rel in files:
        text = src.read(rel)
        if text is None or not pat.search(text):
            continue
        mod = _parse(src, rel)
        if mod is None:
            continue
        imports = {}
        pkg = rel.rsplit("/", 1)[0].split("/")
        for node in ast.walk(mod):
            if isinstance(node, ast.ImportFrom) and node.module:
                # `from .interfaces import X` (vLLM) is relative to the file's package
                base = ".".join(pkg[:len(pkg) - node.level + 1]) + "." if node.level else ""
                for a in node.names:
                    imports[a.asname or a.name] = base + node.module
        for node in mod.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return ClassInfo(name, rel, node, imports)
    return None


def find_method(src: Source, cls: ClassInfo, method: str, depth: int = 0) -> tuple[ast.FunctionDef, ClassInfo] | None:
    """`method` as the class resolves it: its own, else its bases' left to right (Python's MRO for the single
    and mixin inheritance the model files use)."""
    for node in cls.node.body:
        if isinstance(node, ast.FunctionDef) and node.name == method:
            return node, cls
    if depth > 8:
        return None
    for b in cls.node.bases:
        base = b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else None
        if base is None or base in ("Module", "PreTrainedModel", "object"):
            continue
        mod = cls.imports.get(base)
        hint = cls.file if mod is None else mod.replace(".", "/") + ".py"
        info = find_class(src, base, hint)
        if info is not None:
            found = find_method(src, info, method, depth + 1)
            if found is not None:
                return found
    return None


def run_function(fn: ast.FunctionDef, file: str, args: list[Any], env: dict[str, Any]) -> Any:
    """Run one function read from the engine's file on stand-in arguments. Annotations and decorators are dropped
    (they name the engine's types); `env` supplies the few globals the body calls."""
    fn = ast.fix_missing_locations(_strip(fn))
    code = compile(ast.Module(body=[fn], type_ignores=[]), f"<{file}>", "exec")
    ns: dict[str, Any] = {"__builtins__": __builtins__, "logger": logging.getLogger("eyas.engine_source"), **env}
    exec(code, ns)  # noqa: S102 - the engine's own function, on stand-ins (module docstring)
    return ns[fn.name](*args)


def _strip(fn: ast.FunctionDef) -> ast.FunctionDef:
    import copy

    fn = copy.deepcopy(fn)
    fn.decorator_list, fn.returns = [], None
    for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs, fn.args.vararg, fn.args.kwarg]:
        if a is not None:
            a.annotation = None
    return fn


# ---- SGLang: which layers the target captures for a draft's ids -------------------------------------

@dataclass
class Tapped:
    """What one architecture's capture rule does with ids, as its code ran on a stand-in."""

    layers: list[int] | None  # layers_to_capture (the residual stream entering layer i = stream i); None: refused
    source: str  # file and Class.method the rule came from
    final: bool = False  # the model also captures after its last layer (stream L) when L is listed
    note: str = ""


class _Inner:
    """The stand-in for the target's inner model: it has layers and records what the rule sets."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [SimpleNamespace() for _ in range(num_layers)]
        self.layers_to_capture: list[int] | None = None
        self.capture_aux_hidden_states = False

    def set_eagle3_layers_to_capture(self, layers: list[int]) -> None:
        # every inner model's method in 0.5.23 (qwen2_moe, qwen3_5, qwen3_next) stores the list it is given
        self.layers_to_capture = list(layers)


def sglang_tapped(src: Source, architecture: str, ids: list[int] | None, num_layers: int) -> Tapped:
    """Run the release's `set_eagle3_layers_to_capture` for `architecture` on `ids` (None: the draft config has
    none) with a stand-in target of `num_layers` layers."""
    cls = find_class(src, architecture)
    if cls is None:
        return Tapped(None, f"no class {architecture} in {MODELS_DIR['sglang']}", note="unknown architecture")
    found = find_method(src, cls, "set_eagle3_layers_to_capture")
    if found is None:
        return Tapped(None, f"{cls.file} {architecture}", note="the class has no set_eagle3_layers_to_capture: "
                      "SGLang refuses EAGLE3 for this target")
    fn, owner = found
    where = f"{owner.file} {owner.name}.set_eagle3_layers_to_capture"
    inner = _Inner(num_layers)
    lm = SimpleNamespace(calls=[])
    lm.set_eagle3_layers_to_capture = lambda x=None: lm.calls.append(x)
    par = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True))
    cfg = SimpleNamespace(num_hidden_layers=num_layers, text_config=SimpleNamespace(num_hidden_layers=num_layers))
    me = SimpleNamespace(pp_group=par.pp_group, config=cfg, model=inner, language_model=lm,
                         capture_aux_hidden_states=False)
    env = {"get_parallel": lambda: par, "PPMissingLayer": type("PPMissingLayer", (), {})}
    try:
        run_function(fn, owner.file, [me, None if ids is None else list(ids)], env)
    except Exception as e:  # noqa: BLE001 - a rule that does not run on the stand-in is reported, not guessed
        return Tapped(None, where, note=f"the rule did not run on a stand-in ({type(e).__name__}: {e})")
    if lm.calls:
        inner_arch = WRAPS.get(architecture)
        if inner_arch is None:
            return Tapped(None, where, note="delegates to its language model, whose class eyas does not know")
        t = sglang_tapped(src, inner_arch, lm.calls[0], num_layers)
        return Tapped(t.layers, f"{where} -> {t.source}", t.final, t.note)
    layers = inner.layers_to_capture
    if layers is None:
        return Tapped(None, where, note="the rule set no layers on the stand-in")
    return Tapped([int(x) for x in layers], where, _captures_final(src, owner.file))


def _captures_final(src: Source, rel: str) -> bool:
    """Whether the model file's forward also captures after the last layer (gpt_oss.py: `self.end_layer in
    self.layers_to_capture`); others capture only on entering a layer."""
    text = src.read(rel) or ""
    return bool(re.search(r"end_layer in self\.layers_to_capture|len\(self\.layers\) in self\.layers_to_capture",
                          text))


def classify(tapped: Any, num_layers: int = 12) -> str:
    """Name a rule by what it does to probe ids: `tapped(ids, L)` -> layers. One of plus1, plus1_if_first_is_1,
    as_is_if_max_is_L, as_is, or other."""
    L = num_layers
    a, b, c = tapped([1, 5, 9], L), tapped([2, 5, 9], L), tapped([2, 5, L], L)
    if a == [2, 6, 10] and b == [3, 6, 10] and c == [3, 6, L + 1]:
        return "plus1"
    if a == [2, 6, 10] and b == [2, 5, 9] and c == [2, 5, L]:
        return "plus1_if_first_is_1"
    if a == [2, 6, 10] and b == [3, 6, 10] and c == [2, 5, L]:
        return "as_is_if_max_is_L"
    if a == [1, 5, 9] and b == [2, 5, 9] and c == [2, 5, L]:
        return "as_is"
    return "other"


# ---- what a loader reads from the draft's config.json ----------------------------------------------

def config_keys(src: Source, rel: str) -> set[str]:
    """Keys the file reads from a config: `config.k`, `getattr(config, "k")`, `hasattr(config, "k")` (config or
    self.config), and eagle_config's `.get("k")` / `["k"]` as `eagle_config.k`."""
    mod = _parse(src, rel)
    if mod is None:
        return set()

    def is_cfg(n: ast.AST) -> bool:
        return (isinstance(n, ast.Name) and n.id in ("config", "hf_config")) or (
            isinstance(n, ast.Attribute) and n.attr == "config" and isinstance(n.value, ast.Name))

    def is_ec(n: ast.AST) -> bool:
        return isinstance(n, ast.Name) and n.id == "eagle_config"

    keys: set[str] = set()
    for n in ast.walk(mod):
        if isinstance(n, ast.Attribute) and is_cfg(n.value) and not isinstance(n.ctx, ast.Store):
            keys.add(n.attr)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr") \
                and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str):
            if is_cfg(n.args[0]):
                keys.add(n.args[1].value)
            elif is_ec(n.args[0]):
                keys.add("eagle_config." + n.args[1].value)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" \
                and is_ec(n.func.value) and n.args and isinstance(n.args[0], ast.Constant):
            keys.add(f"eagle_config.{n.args[0].value!s}")  # a constant key: str in practice
        elif isinstance(n, ast.Subscript) and is_ec(n.value) and isinstance(n.slice, ast.Constant):
            keys.add(f"eagle_config.{n.slice.value!s}")
    return keys


def class_fields(src: Source, rel: str, name: str) -> list[str] | None:
    """The annotated fields of a class (a pydantic model such as SGLang's SpecTokensDetails); None when absent."""
    mod = _parse(src, rel)
    for node in (mod.body if mod else []):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    return None


def function_node(src: Source, rel: str, name: str) -> ast.FunctionDef | None:
    """A function defined at any depth of the file (a method included)."""
    mod = _parse(src, rel)
    for n in ast.walk(mod) if mod else []:
        if isinstance(n, ast.FunctionDef) and n.name == name:
            return n
    return None


# ---- vLLM: the ids it takes from a draft config, and the layers a target captures ----------------------

VLLM_RUNNER = "vllm/v1/worker/gpu_model_runner.py"


def vllm_config_ids(src: Source, config: dict[str, Any]) -> list[int] | None:
    """Run the release's `_get_eagle3_aux_layers_from_config` on a stand-in runner whose draft config is `config`;
    None: vLLM then asks the target for its default layers."""
    fn = function_node(src, VLLM_RUNNER, "_get_eagle3_aux_layers_from_config")
    if fn is None:
        raise SourceError(f"{src.label()}: no _get_eagle3_aux_layers_from_config in {VLLM_RUNNER}")
    hf = SimpleNamespace(**config)
    me = SimpleNamespace(speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf)))
    out = run_function(fn, VLLM_RUNNER, [me], {})
    return None if out is None else [int(x) for x in out]


class _Holder:
    """The stand-in for vLLM's EagleModelMixin holder (the target's inner model)."""

    aux_hidden_state_layers: tuple[int, ...] = ()

    def _cache_aux_pp_layout(self) -> None:  # pipeline-parallel bookkeeping: nothing to record here
        pass


def vllm_tapped(src: Source, architecture: str, ids: list[int], num_layers: int) -> Tapped:
    """Run the architecture's `set_aux_hidden_state_layers` (its own, or SupportsEagle3's through its bases) on a
    stand-in target. vLLM captures after each layer idx as stream idx + 1 (and the embedding as 0), so the
    layers it records are stream indices, 0..L."""
    cls = find_class(src, architecture)
    if cls is None:
        return Tapped(None, f"no class {architecture} in {MODELS_DIR['vllm']}", note="unknown architecture")
    found = find_method(src, cls, "set_aux_hidden_state_layers")
    if found is None:
        return Tapped(None, f"{cls.file} {architecture}", note="no set_aux_hidden_state_layers: vLLM refuses "
                      "EAGLE-3 for this target")
    fn, owner = found
    where = f"{owner.file} {owner.name}.set_aux_hidden_state_layers"
    mixin = find_class(src, "EagleModelMixin", "vllm/model_executor/models/interfaces.py")
    setter = find_method(src, mixin, "_set_aux_hidden_state_layers") if mixin else None
    holder = _Holder()
    if setter is not None:
        holder._set_aux_hidden_state_layers = (  # type: ignore[attr-defined]
            lambda layers: run_function(setter[0], setter[1].file, [holder, layers], {}))
    me = SimpleNamespace(model=holder)
    lm = SimpleNamespace(calls=[])
    lm.set_aux_hidden_state_layers = lambda x: lm.calls.append(x)
    try:
        try:
            run_function(fn, owner.file, [me, tuple(ids)], {"EagleModelMixin": _Holder})
        except AttributeError as e:
            if "language_model" not in str(e):
                raise
            me.language_model = lm  # a wrapper that hands the ids to its language model (kimi_k25.py)
            run_function(fn, owner.file, [me, tuple(ids)], {"EagleModelMixin": _Holder})
    except Exception as e:  # noqa: BLE001 - reported, not guessed
        return Tapped(None, where, note=f"the rule did not run on a stand-in ({type(e).__name__}: {e})")
    if lm.calls:
        inner = WRAPS.get(architecture)
        if inner is None:
            return Tapped(None, where, note="delegates to its language model, whose class eyas does not know")
        t = vllm_tapped(src, inner, list(lm.calls[0]), num_layers)
        return Tapped(t.layers, f"{where} -> {t.source}", t.final, t.note)
    return Tapped(sorted({int(x) for x in holder.aux_hidden_state_layers}), where, final=True)


# ---- SGLang's launch-time facts ------------------------------------------------------------------------

_IDS_READERS = ("sglang/srt/model_executor/model_runner.py",
                "sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py")
_TOPK_FILES = ("sglang/srt/server_args.py", "sglang/srt/arg_groups/speculative_hook.py")


def sglang_silent_default(src: Source) -> tuple[bool, str] | None:
    """Whether a draft config without eagle_config ids is caught silently: the `try` that reads
    eagle_config["eagle_aux_hidden_state_layer_ids"] and whose handler sets None without a call (no log line).
    (silent, file), or None when no such reader is found."""
    for rel in _IDS_READERS:
        mod = _parse(src, rel)
        for node in ast.walk(mod) if mod else []:
            if not isinstance(node, ast.Try):
                continue
            reads = any(isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant)
                        and n.slice.value == "eagle_aux_hidden_state_layer_ids" for b in node.body for n in ast.walk(b))
            if reads and node.handlers:
                calls = [n for h in node.handlers for b in h.body for n in ast.walk(b) if isinstance(n, ast.Call)]
                return not calls, rel
    return None


def sglang_topk1_rewrite(src: Source) -> str | None:
    """The file where topk 1 rewrites num_draft_tokens to steps + 1 with a warning, or None."""
    for rel in _TOPK_FILES:
        if "speculative_num_draft_tokens is adjusted to speculative_num_steps + 1" in (src.read(rel) or ""):
            return rel
    return None
