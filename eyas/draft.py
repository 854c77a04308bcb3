"""The EAGLE-3 draft head (SGLang/vLLM `LlamaForCausalLMEagle3` compatible) and its checkpoint format.

fc: cat(aux features) [.., n_aux*Ht] -> [.., H]; one decoder layer whose attention input is
cat(input_layernorm(embed(x)), hidden_norm(h)) [.., 2H]; residual h; norm -> lm_head over the draft
vocabulary; target_id = draft_id + d2t[draft_id]. The layer output (pre-norm) is fed back as h.
EAGLE 3.1 (`fc_norm`): an RMSNorm per aux state before fc, cat(fc_norm[i](f_i)) -> fc, as SpecForge
(specforge/modeling/draft/llama3_eagle.py project_hidden_states), speculators (models/eagle3/core.py, --fc-norm) and
vLLM 0.32 (model_executor/models/llama_eagle3.py combine_hidden_states) compute it; weights `fc_norm.{i}.weight`.
Token embeddings come from the target: a non-persistent buffer, never stored in the checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from .conventions import sglang_config_ids, vllm_config_ids
from .errors import EyasError
from .files import atomic_folder, check_file, file_record, save_safetensors
from .layout import Layout, LayoutError, TargetIdentity, layout_diff
from .metadata import DRAFT_MANIFEST, read_metadata
from .rope import apply_rope, rope_cos_sin
from .target.family import text_config
from .target.load import Target

WEIGHTS = "model.safetensors"
MANIFEST = "eyas_manifest.json"


class DraftError(EyasError):
    pass


@dataclass
class DraftConfig:
    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    num_aux: int = 3
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    fc_norm: bool = False  # EAGLE 3.1: one RMSNorm (target_hidden_size wide) per aux state before fc

    @classmethod
    def from_target_config(cls, tcfg: Any, draft_vocab_size: int, num_aux: int = 3, **overrides) -> DraftConfig:
        tcfg = text_config(tcfg)
        H = int(tcfg.hidden_size)
        nh = int(tcfg.num_attention_heads)
        rope = getattr(tcfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        theta = theta or getattr(tcfg, "rope_theta", None) or 10000.0
        cfg: dict[str, Any] = dict(
            hidden_size=H,
            target_hidden_size=H,
            num_attention_heads=nh,
            num_key_value_heads=int(getattr(tcfg, "num_key_value_heads", None) or nh),
            head_dim=int(getattr(tcfg, "head_dim", None) or H // nh),
            intermediate_size=int(tcfg.intermediate_size),
            vocab_size=int(tcfg.vocab_size),
            draft_vocab_size=int(draft_vocab_size),
            num_aux=num_aux,
            rms_norm_eps=float(getattr(tcfg, "rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=int(getattr(tcfg, "max_position_embeddings", 8192)),
        )
        cfg.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**cfg)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DraftConfig:
        names = {f.name for f in fields(cls)}
        required = [f.name for f in fields(cls) if f.default is MISSING]
        missing = [n for n in required if n not in d]
        if missing:
            raise DraftError(f"draft config lacks {missing}; found keys {sorted(d)}")
        return cls(**{k: v for k, v in d.items() if k in names})

    def hf_config(self, layout: Layout | None) -> dict[str, Any]:
        """config.json in the SGLang/SpecForge `LlamaForCausalLMEagle3` shape, ids explicit."""
        out: dict[str, Any] = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "target_hidden_size": self.target_hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }
        if self.fc_norm:  # the key SpecForge writes and vLLM 0.32 reads (getattr(config, "fc_norm"))
            out["fc_norm"] = True
        if layout is not None and layout.target is not None:
            try:
                # both engines' entries: each reads only its own (eyas/conventions.py), and without vLLM's some
                # vLLM builds use SGLang's eagle_config ids as-is (off by one) and others the target default
                out.update(sglang_config_ids(layout.aux_indices, layout.target.num_layers,
                                             layout.target.architecture))
                out.update(vllm_config_ids(layout.aux_indices, layout.target.num_layers, semantics=False))
            except LayoutError:
                pass  # not expressible in SGLang; the eyas manifest still holds the truth
        return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class DraftAttention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class DraftMLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DraftAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = DraftMLP(c)


class Eagle3Draft(nn.Module):
    # buffers registered in __init__ (nn.Module's __getattr__ alone types them Tensor | Module)
    d2t: torch.Tensor
    t2d: torch.Tensor
    embed_weight: torch.Tensor

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(c.num_aux * c.target_hidden_size, c.hidden_size, bias=False)
        self.fc_norm = nn.ModuleList([RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in range(c.num_aux)]) \
            if c.fc_norm else None
        self.midlayer = DraftLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        # the target's frozen token embeddings; not persistent: never stored with the draft
        self.register_buffer("embed_weight", torch.empty(0), persistent=False)

    # -- wiring -----------------------------------------------------------------------------------
    def set_embeddings(self, weight: torch.Tensor) -> None:
        c = self.config
        if tuple(weight.shape) != (c.vocab_size, c.hidden_size):
            raise DraftError(f"target embeddings have shape {tuple(weight.shape)}, the draft expects "
                             f"({c.vocab_size}, {c.hidden_size}) (vocab, hidden): wrong target for this draft")
        self.embed_weight = weight.detach()

    def set_vocab_map(self, draft_to_target: torch.Tensor) -> None:
        """draft_to_target [Vd] target ids (sorted ascending) -> d2t offsets and t2d mask."""
        ids = draft_to_target.long().cpu()
        if ids.numel() != self.config.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise DraftError(f"draft vocab map needs {self.config.draft_vocab_size} distinct target ids, "
                             f"got {ids.numel()} ({ids.unique().numel()} distinct)")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_token_ids(self) -> torch.Tensor:
        """[Vd] the target id of every draft-vocab entry."""
        return self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))

    # -- compute ----------------------------------------------------------------------------------
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """cat(aux) features [.., n_aux*Ht] -> fc output [.., H]; an EAGLE 3.1 draft first normalises each aux
        state on its own (fc_norm)."""
        if self.fc_norm is not None:
            chunks = features.chunk(len(self.fc_norm), dim=-1)  # n_aux x [.., Ht]
            features = torch.cat([norm(x) for norm, x in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(features)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_weight.numel() == 0:
            raise DraftError("draft has no token embeddings: call set_embeddings(target embedding weight)")
        return F.embedding(input_ids, self.embed_weight)

    def qkv(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor):
        """hidden [B,S,H] (fc output or fed-back layer output), input_ids [B,S], position_ids [B,S]
        -> q [B,nh,S,hd], k/v [B,nkv,S,hd] (RoPE applied)."""
        c, layer = self.config, self.midlayer
        B, S, _ = hidden.shape
        x = torch.cat([layer.input_layernorm(self.embed(input_ids).to(hidden.dtype)),
                       layer.hidden_norm(hidden)], dim=-1)  # [B, S, 2H]
        attn = layer.self_attn
        q = attn.q_proj(x).view(B, S, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(B, S, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(B, S, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(position_ids, c.head_dim, c.rope_theta, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, attn_out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """attn_out [B,nh,S,hd], residual hidden [B,S,H] -> layer output [B,S,H] (pre-norm)."""
        B, _, S, _ = attn_out.shape
        layer = self.midlayer
        h = hidden + layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(B, S, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [B,nh,Q,hd], k/v [B,nkv,K,hd], mask bool [B or 1, 1, Q, K] (True = may attend) or None (causal)."""
        rep = self.config.num_attention_heads // self.config.num_key_value_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                past_kv: tuple[torch.Tensor, torch.Tensor] | None = None, mask: torch.Tensor | None = None):
        """One draft step over S new rows. Keys/values of the new rows are appended after past_kv;
        `mask` [B or 1, 1, S, past+S] must then be given (None means plain causal with no past).
        Returns (layer output [B,S,H], (k, v) of past+new)."""
        q, k, v = self.qkv(hidden, input_ids, position_ids)
        if past_kv is not None:
            k = torch.cat([past_kv[0], k], dim=2)
            v = torch.cat([past_kv[1], v], dim=2)
            if mask is None:
                raise DraftError("a mask is required when attending over a past KV cache")
        out = self.finish(self.attend(q, k, v, mask), hidden)
        return out, (k, v)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """layer output [B,S,H] -> draft-vocab logits [B,S,Vd]."""
        return self.lm_head(self.norm(out))


# ---- checkpoint ----------------------------------------------------------------------------------

@dataclass
class DraftCheckpoint:
    model: Eagle3Draft
    layout: Layout
    manifest: dict[str, Any]
    path: Path | None = None


def save_draft(path: str | Path, model: Eagle3Draft, layout: Layout, extra: dict[str, Any] | None = None,
               dtype: torch.dtype | None = None) -> Path:
    """Write weights + config.json + eyas manifest into `path` atomically (tmp folder + rename)."""
    sd = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if dtype is not None:
        sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()}
    manifest = {"kind": "eyas-draft", "format_version": 1, "layout": layout.to_dict(),
                "draft_config": model.config.to_dict(), **(extra or {})}

    def write(tmp: Path) -> None:
        save_safetensors(sd, tmp / WEIGHTS, metadata={"format": "pt", "producer": "eyas"})
        (tmp / "config.json").write_text(json.dumps(model.config.hf_config(layout), indent=2))
        # the weights' size and digest, checked by load_draft (replaces any `files` an `extra` carried over)
        manifest["files"] = {WEIGHTS: file_record(tmp / WEIGHTS)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))

    return atomic_folder(path, write)


def bundled_draft_path(name: str = "default") -> Path:
    return Path(__file__).parent / "assets" / "drafts" / name


def draft_folder(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """An eyas draft folder ('default': the bundled one) and its checked manifest, read without the weights: what
    load_draft reads first, and what a command checks before its target loads."""
    p = bundled_draft_path() if str(path) == "default" else Path(path)
    if not p.is_dir():
        raise DraftError(f"--draft {path}: no such folder; expected an eyas draft folder (from `eyas train` or "
                         "`eyas import`), 'default', 'random' or 'none'")
    man_path = p / MANIFEST
    if not man_path.exists():
        raise DraftError(
            f"{p} has no {MANIFEST}: it is not an eyas draft, so its layer ids' convention is unknown. "
            f"Convert it with `eyas import {p} --target T --out DIR`, which translates or infers the layout.")
    manifest = read_metadata(man_path, DRAFT_MANIFEST, DraftError, "the checkpoint is corrupt — re-export it")
    if manifest["kind"] != "eyas-draft":
        raise DraftError(f"{man_path}: kind is {manifest['kind']!r}, expected 'eyas-draft'")
    return p, manifest


def load_draft(path: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> DraftCheckpoint:
    """Load an eyas draft folder. Foreign (SGLang/vLLM/speculators) folders go through `eyas import`."""
    p, manifest = draft_folder(path)
    layout = Layout.from_dict(manifest["layout"])
    cfg = DraftConfig.from_dict(manifest["draft_config"])
    if cfg.num_aux != layout.num_aux:
        raise DraftError(f"draft fc takes {cfg.num_aux} aux states but the layout lists {layout.num_aux} "
                         f"indices {layout.aux_indices}")
    wpath = p / WEIGHTS
    if not wpath.exists():
        raise DraftError(f"{p} lacks {WEIGHTS}")
    # drafts written before eyas recorded digests have no `files`: they load unchecked, as before
    check_file(wpath, (manifest.get("files") or {}).get(WEIGHTS), DraftError,
               "the draft is damaged: copy it again, or rerun the command that wrote it")
    try:
        sd = load_file(str(wpath))
    except Exception as e:  # safetensors raises several types on corrupt headers
        raise DraftError(f"{wpath} is not a readable safetensors file ({e}); the checkpoint is corrupt") from e
    model = Eagle3Draft(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in sd.items()}
    problems = [f"missing {k} {s}" for k, s in expected.items() if k not in found]
    problems += [f"unexpected {k} {s}" for k, s in found.items() if k not in expected]
    problems += [f"{k}: expected shape {expected[k]}, found {found[k]}" for k in expected
                 if k in found and expected[k] != found[k]]
    if problems:
        raise DraftError(f"{wpath} does not match its config: " + "; ".join(problems[:8]))
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()})
    model.to(device=device, dtype=dtype)
    model.eval()
    return DraftCheckpoint(model=model, layout=layout, manifest=manifest, path=p)


def _describe_identity(t: TargetIdentity | None, fallback: str) -> str:
    if t is None:
        return fallback
    return (f"{t.name or t.model_type} ({t.model_type}, {t.num_layers} layers, hidden {t.hidden_size}, "
            f"vocab {t.vocab_size})")


def draft_misfit(ckpt: DraftCheckpoint, target: Target) -> list[str]:
    """How a draft does not fit a target, field by field (empty when it fits): the recorded layout's target
    identity (fingerprint included), its stream indices within the target's layers, and the shapes it was built
    for. Needs the target's config only (a target loaded without weights will do)."""
    problems = []
    try:
        here = target.default_layout(ckpt.layout.aux_indices)
    except LayoutError:  # indices beyond this target's layers: a deeper model's draft
        here = None
        problems.append(f"aux stream indices {list(ckpt.layout.aux_indices)} beyond the target's "
                        f"{target.num_layers} layers")
    if here is not None:
        problems += [f"{name} {a!r} vs {b!r}" for name, a, b in layout_diff(ckpt.layout, here)]
    c = ckpt.model.config
    if c.target_hidden_size != target.hidden_size:
        problems.append(f"target_hidden_size {c.target_hidden_size} vs {target.hidden_size}")
    if c.vocab_size != target.identity.vocab_size:
        problems.append(f"vocab_size {c.vocab_size} vs {target.identity.vocab_size}")
    width = target.embed_tokens().weight.shape[1]
    if width != c.hidden_size:
        problems.append(f"hidden {c.hidden_size} vs the target's embedding width {width}")
    return problems


def check_draft_for_target(ckpt: DraftCheckpoint, target: Target,
                           instead: str = "decode this one without a draft (--method lookup or plain)") -> None:
    """Refuse a draft made for another target in one line naming both targets, what differs (draft's vs
    target's) and what to run instead."""
    problems = draft_misfit(ckpt, target)
    if not problems:
        return
    where = "the bundled draft" if ckpt.path is not None and Path(ckpt.path) == bundled_draft_path() else \
        f"the draft {ckpt.path}" if ckpt.path is not None else "the draft"
    more = f" (+{len(problems) - 4} more)" if len(problems) > 4 else ""
    raise DraftError(f"{where} was trained for {_describe_identity(ckpt.layout.target, 'another target')}, not for "
                     f"{_describe_identity(target.identity, target.source)}: {'; '.join(problems[:4])}{more}. "
                     f"Use it with the target it was trained for, {instead}, or train a draft for it (eyas datagen, "
                     "then eyas train)")


# ---- which draft a command runs with (--draft) -------------------------------------------------------

def random_draft(target: Target, draft_vocab: int = 8192, seed: int = 0) -> DraftCheckpoint:
    """An untrained EAGLE-3 draft for `target` (an eyas.target.Target): random weights, draft vocab = the
    first target ids. Its acceptance is near zero: it proves the plumbing, never the speed."""
    vocab = target.identity.vocab_size
    cfg = DraftConfig.from_target_config(target.config, min(draft_vocab, vocab))
    torch.manual_seed(seed)
    model = Eagle3Draft(cfg)
    model.set_vocab_map(torch.arange(cfg.draft_vocab_size))
    manifest = {"kind": "eyas-draft", "untrained": True, "note": f"random weights (seed {seed}), made by eyas bench",
                "draft_config": cfg.to_dict()}
    model.to(device=target.device, dtype=target.dtype).eval()
    return DraftCheckpoint(model=model, layout=target.default_layout(), manifest=manifest, path=None)


def save_random_draft(target: Target, path: str | Path, draft_vocab: int = 8192, seed: int = 0) -> Path:
    ckpt = random_draft(target, draft_vocab, seed)
    return save_draft(path, ckpt.model.float(), ckpt.layout, extra={"untrained": True, "note": ckpt.manifest["note"]})


def check_default_draft(spec: str, instead: str = "--draft none with --method plain") -> None:
    """Fail before any model loads when --draft names nothing to load: the bundled draft not shipped (`instead`
    is the command's own way to run without a draft), or a path that is not an eyas draft folder."""
    if spec == "default" and not bundled_draft_path().is_dir():
        raise DraftError(f"the bundled draft ({bundled_draft_path()}) is not shipped in this install: pass --draft "
                         "PATH (an eyas draft folder, e.g. from `eyas train`), --draft random (untrained: the "
                         f"plumbing, not the speed) or {instead}")
    if spec not in ("default", "random", "none"):
        draft_folder(spec)


def recorded_template(spec: str | None) -> dict[str, Any] | None:
    """The chat-template record in the manifest of the draft --draft names (a folder or 'default'), read before
    anything loads; None for 'none', 'random', or a folder whose manifest cannot be read (loading it says why)."""
    if spec in (None, "none", "random"):
        return None
    path = (bundled_draft_path() if spec == "default" else Path(spec)) / MANIFEST
    try:
        record = read_metadata(path, DRAFT_MANIFEST, DraftError, "").get("chat_template")
    except (OSError, DraftError):
        return None
    return record


def resolve_draft(spec: str, target: Target) -> DraftCheckpoint | None:
    """--draft: a folder, 'default' (bundled), 'random' (untrained: plumbing only) or 'none' -> the draft on
    the target's device and dtype (None for 'none')."""
    if spec == "none":
        return None
    if spec == "random":
        return random_draft(target)
    check_default_draft(spec)
    return load_draft(spec, device=target.device, dtype=target.dtype)
