"""What a GGUF's metadata and tensors say about the computation, beyond what transformers' GGUF reader keeps.

transformers reads a llama.cpp GGUF into a HF config, but drops what changes the model's output: Llama 3 RoPE
scaling (llama.cpp's convert_hf_to_gguf.py stores it only as the per-dimension `rope_freqs.weight` divisors, no
`rope.scaling.*` keys), linear RoPE scaling (`rope.scaling.type`/`factor`, mapped for gpt-oss only), Qwen3's
head size (`attention.key_length`), Mistral's sliding window (transformers' default 4096, where llama.cpp's llama
graph attends to every token), and Gemma 3's attention scale (not in the file: llama.cpp's llama_model::
load_hparams uses 1/sqrt(head_dim), 1/sqrt(hidden/heads) for the 62-layer 27B; transformers' default
query_pre_attn_scalar is 256). `gguf_overrides` reads all of it into config attributes, or refuses what eyas
cannot compute the way llama.cpp does: a GGUF target never silently runs another model."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from .family import TargetError

# llama.cpp `general.architecture` values whose keys this module reads (transformers' model_type differs for gemma3)
_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
_TOL: dict[str, Any] = dict(rtol=1e-5, atol=1e-6)  # fp32: the converter computes the divisors in float32


def llama3_divisors(theta: float, dim: int, factor: float, low: float, high: float, orig: float) -> torch.Tensor:
    """[dim/2] fp32: what llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors) writes as
    `rope_freqs.weight` for Llama 3 RoPE scaling; llama.cpp divides each base frequency by it (the same
    frequencies as transformers' _compute_llama3_parameters)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    wavelen = 2 * math.pi / freqs
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    out = torch.where(wavelen < orig / high, torch.ones_like(freqs), mid)
    return torch.where(wavelen > orig / low, torch.full_like(freqs, factor), out)


def _grid() -> list[tuple[float, float, int]]:
    """(low_freq_factor, high_freq_factor, original_max_position_embeddings) tried in order: Llama 3.x's own
    (1, 4, 8192) first, then the same factors at other power-of-two lengths, then other factor pairs. Only the
    ratios orig/low and orig/high change the divisors, so the first that fits is as good as any other."""
    lengths = [8192] + [2 ** k for k in range(4, 21) if k != 13]
    pairs = [(1.0, 4.0)] + [(lo, hi) for lo in (1.0, 0.5, 2.0) for hi in (2.0, 8.0, 1.5, 3.0, 16.0, 32.0)
                            if hi > lo]
    return [(lo, hi, n) for lo, hi in pairs for n in lengths]


def _solved(wavelen: torch.Tensor, r: torch.Tensor, factor: float, high: torch.Tensor, low: torch.Tensor,
            mid: torch.Tensor) -> list[tuple[float, float, int]]:
    """Parameters solved from the divisors themselves, for what the grid misses. In the smooth band
    s = (1/r - 1/factor) / (1 - 1/factor) = (orig/wavelen - low) / (high - low): two smooth dims give orig/low
    and orig/high (a line in 1/wavelen); one gives orig for each (low, high) pair; none leaves a gap between the
    unscaled and the fully scaled dims, and any boundaries inside it fit."""
    s = (1 / r[mid] - 1 / factor) / (1 - 1 / factor)
    w = wavelen[mid]
    out: list[tuple[float, float, int]] = []
    if len(w) >= 2:
        u = 1 / w
        a, b = torch.linalg.lstsq(torch.stack([u, torch.ones_like(u)], 1), s[:, None]).solution[:, 0].tolist()
        if a > 0 and -b / a > 0:
            p, q = -b / a, -b / a + 1 / a  # low/orig, high/orig
            n = max(1, round(1 / p))
            out.append((n * p, n * q, n))
    elif len(w) == 1:
        for lo, hi, _ in _grid()[::17]:  # one per (low, high) pair
            out.append((lo, hi, max(1, round(float(w[0] * (s[0] * (hi - lo) + lo))))))
    elif high.any() and low.any() and float(wavelen[high].max()) < float(wavelen[low].min()):
        n = max(1, math.floor(float(wavelen[low].min()) * 0.999))
        out.append((1.0, n / (float(wavelen[high].max()) * 1.001), n))
    return out


def recover_llama3(divisors: torch.Tensor, theta: float, dim: int) -> dict[str, Any] | None:
    """The llama3 rope parameters (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    whose divisors equal `divisors` to fp32 tolerance; None if no such parameters exist."""
    r = divisors.float().reshape(-1)
    if r.numel() != dim // 2 or not torch.isfinite(r).all() or (r <= 0).any():
        return None
    factor = float(r.max())
    cands = _grid()
    wavelen = 2 * math.pi * theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    rd = r.double()
    high = torch.isclose(rd, torch.ones_like(rd), rtol=1e-5)
    low = torch.isclose(rd, torch.full_like(rd, factor), rtol=1e-5)
    mid = ~(high | low)
    if factor > 1:
        cands += _solved(wavelen, rd, factor, high, low, mid)
    for lo, hi, n in cands:
        if hi > lo and torch.allclose(llama3_divisors(theta, dim, factor, lo, hi, n), r, **_TOL):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": lo, "high_freq_factor": hi,
                    "original_max_position_embeddings": n}
    return None


def _rope_freqs(gguf: Path, tensors: dict) -> torch.Tensor:
    t = tensors["rope_freqs.weight"]
    if t.type_name != "F32":
        raise TargetError(f"{gguf.name}: rope_freqs.weight is {t.type_name}; llama.cpp writes it as F32 (per-dim "
                          "RoPE divisors): convert the model again with llama.cpp's convert_hf_to_gguf.py")
    import numpy as np

    return torch.from_numpy(np.ascontiguousarray(t.data).view(np.float32).copy())


def _rope(gguf: Path, arch: str, meta: dict, tensors: dict, theta: float, head_dim: int) -> dict[str, Any]:
    """The rope_parameters (transformers 5) for the GGUF's global attention."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    has_freqs = "rope_freqs.weight" in tensors
    if has_freqs and arch != "llama":
        raise TargetError(f"{gguf.name}: a {arch} GGUF with a rope_freqs tensor; llama.cpp's {arch} graph does "
                          "not read it and eyas cannot tell which RoPE the file means: pass the Hugging Face folder")
    if has_freqs and kind not in ("none", None):
        raise TargetError(f"{gguf.name}: both a rope_freqs tensor and {arch}.rope.scaling.type {kind!r}; expected "
                          "one RoPE scaling: convert the model again with llama.cpp's convert_hf_to_gguf.py")
    if has_freqs:
        divisors = _rope_freqs(gguf, tensors)
        if torch.allclose(divisors, torch.ones_like(divisors), **_TOL):
            return {"rope_type": "default", "rope_theta": theta}
        found = recover_llama3(divisors, theta, head_dim)
        if found is None:
            raise TargetError(f"{gguf.name}: its rope_freqs tensor ({divisors.numel()} per-dim RoPE divisors, "
                              f"max {float(divisors.max()):g}) matches no Llama 3 rope scaling (factor, low/high freq "
                              "factor, original context) at rope theta {theta:g}; eyas would run another model: pass "
                              "the Hugging Face folder")
        return {**found, "rope_theta": theta}
    if kind in ("none", None):
        return {"rope_type": "default", "rope_theta": theta}
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and isinstance(factor, (int, float)) and factor > 0:
        return {"rope_type": "linear", "factor": float(factor), "rope_theta": theta}
    raise TargetError(f"{gguf.name}: {arch}.rope.scaling.type {kind!r} (factor {factor}); eyas runs GGUF targets "
                      "with no, linear or Llama 3 RoPE scaling: pass the Hugging Face folder")


def _refuse_keys(gguf: Path, arch: str, meta: dict) -> None:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        v = meta.get(f"{arch}.{key}")
        if isinstance(v, (int, float)) and v:
            # llama.cpp's llama/qwen graphs and its interleaved-window gemma3 graph do not read these keys
            raise TargetError(f"{gguf.name}: {arch}.{key} = {v:g}; llama.cpp's {arch} graph ignores it and "
                              "transformers applies it, so the file means two models: pass the Hugging Face folder")
    if f"{arch}.attention.layer_norm_rms_epsilon" not in meta:
        raise TargetError(f"{gguf.name}: no {arch}.attention.layer_norm_rms_epsilon (llama.cpp requires it); "
                          "convert the model again with llama.cpp's convert_hf_to_gguf.py")


def gguf_overrides(gguf: Path) -> dict[str, Any]:
    """Config attributes (transformers 5 names) a GGUF's metadata and tensors fix, to set on the config
    transformers reads from it; {} for an architecture this module does not know (transformers' reading stands).
    Raises TargetError for a file whose model eyas cannot compute as llama.cpp does."""
    from ..native.gguf_file import read_gguf_metadata, read_gguf_tensors

    meta: dict[str, Any] = read_gguf_metadata(gguf)  # scalars and strings by key: each read as its type below
    arch = meta.get("general.architecture")
    if arch == "qwen3moe":  # transformers' GGUF reader leaves the experts' width at Qwen3MoeConfig's default
        width = meta.get("qwen3moe.expert_feed_forward_length")
        if not isinstance(width, int) or width <= 0:
            raise TargetError(f"{gguf.name}: no qwen3moe.expert_feed_forward_length (the experts' width; "
                              "llama.cpp requires it): convert the model again with llama.cpp's convert_hf_to_gguf.py")
        return {"moe_intermediate_size": width}
    if arch not in _ARCHS:
        return {}
    tensors = read_gguf_tensors(gguf)
    _refuse_keys(gguf, arch, meta)
    heads = int(meta.get(f"{arch}.attention.head_count", 0) or 0)
    hidden = int(meta.get(f"{arch}.embedding_length", 0) or 0)
    head_dim = int(meta.get(f"{arch}.attention.key_length") or (hidden // heads if heads else 0))
    vdim = meta.get(f"{arch}.attention.value_length", head_dim)
    rot = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if not head_dim or vdim != head_dim or rot != head_dim:
        raise TargetError(f"{gguf.name}: head size {head_dim}, value size {vdim}, rotary dims {rot}; eyas runs "
                          "GGUF targets whose keys, values and RoPE span one head size: pass the Hugging Face folder")
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    out: dict[str, Any] = {"head_dim": head_dim,
                           "rms_norm_eps": float(meta[f"{arch}.attention.layer_norm_rms_epsilon"])}
    rope = _rope(gguf, arch, meta, tensors, theta, head_dim)
    if arch != "gemma3":
        out["rope_parameters"] = rope
        if arch == "llama":  # llama.cpp's llama graph has no window (transformers' Mistral defaults to 4096)
            out["sliding_window"] = None
        return out
    window = meta.get("gemma3.attention.sliding_window")
    if not isinstance(window, int) or window <= 0:
        raise TargetError(f"{gguf.name}: no gemma3.attention.sliding_window (llama.cpp requires it); convert "
                          "the model again with llama.cpp's convert_hf_to_gguf.py")
    layers = int(meta.get("gemma3.block_count", 0) or 0)
    # llama.cpp (llama_model::load_hparams, LLM_ARCH_GEMMA3): window on 5 of every 6 layers, base 10000 and no
    # scaling on windowed layers, query scale 1/sqrt(head_dim) except the 62-layer 27B's 1/sqrt(hidden/heads)
    out.update(sliding_window=window,
               layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
               query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,
               rope_parameters={"full_attention": rope,
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    return out


def overrides_hold(saved: dict[str, Any], overrides: dict[str, Any]) -> bool:
    """Whether a saved config.json already carries `overrides` (dict values: as a subset): a cache folder converted
    before an override existed is converted again rather than trusted."""
    for k, v in overrides.items():
        have = saved.get(k)
        if isinstance(v, dict):
            if not isinstance(have, dict) or not overrides_hold(have, v):
                return False
        elif have != v:
            return False
    return True


def rope_summary(cfg: Any) -> str:
    """One line naming the RoPE a loaded config runs with, e.g. 'llama3 factor 8 low 1 high 4 orig 8192, theta
    500000' (Gemma 3: the global layers', then the windowed layers')."""
    rp = getattr(cfg, "rope_parameters", None) or {}

    def one(p: dict[str, Any]) -> str:
        kind = p.get("rope_type", "default")
        extra = ""
        if kind == "llama3":
            extra = (f" factor {p.get('factor'):g} low {p.get('low_freq_factor'):g} high "
                     f"{p.get('high_freq_factor'):g} orig {p.get('original_max_position_embeddings')}")
        elif "factor" in p:
            extra = f" factor {p['factor']:g}"
        theta = p.get("rope_theta", getattr(cfg, "rope_theta", None))
        return f"{kind}{extra}, theta {theta:g}" if isinstance(theta, (int, float)) else f"{kind}{extra}"

    if "full_attention" in rp:
        parts = [f"global {one(rp['full_attention'])}"]
        if "sliding_attention" in rp:
            parts.append(f"windowed {one(rp['sliding_attention'])}")
        return "; ".join(parts)
    return one(rp)
