"""Load a target (bundled SmolLM2, HF folder, GGUF file) with its identity; the one owner of
end-of-turn tokens."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

if TYPE_CHECKING:  # transformers is imported at load time, after hub_offline()
    from transformers import PreTrainedModel

from ..files import cache_dir, read_json
from ..heartbeat import during
from ..layout import Layout, TargetIdentity
from ..option import DEFAULT_TARGET
from .capture import decoder_parts
from .convert import convert_gguf, file_fingerprint
from .device import parse_dtype, resolve_device
from .family import BUNDLED, TargetError, gguf_of, hf_folder, read_config, text_config
from .gguf_config import gguf_overrides, overrides_hold
from .offline import hub_offline


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
    model: PreTrainedModel  # a HF *ForCausalLM
    tokenizer: Any
    identity: TargetIdentity
    source: str  # what the user passed
    path: Path | None  # the HF folder it was loaded from
    load_seconds: float = 0.0
    gguf: Path | None = None  # the .gguf file a converted target came from (its native weights live there)
    native_cache: Any = field(default=None, repr=False)  # eyas.native.quant.NativeWeights once loaded
    chat_template: Any = field(default=None, repr=False)  # eyas.target.template.ChatTemplate a command installed

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
        return cast(nn.Embedding, self.model.get_input_embeddings())  # an nn.Embedding (or a scaled subclass)

    def final_norm(self) -> nn.Module:
        return decoder_parts(self.model)[2]

    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()


def input_embeddings(target: Target) -> torch.Tensor:
    """The target's token embedding matrix [V, H] (the draft's frozen input embeddings). A target loaded without
    weights (load_weights=False: a model too big for this machine) has it read from its safetensors files alone."""
    emb = target.embed_tokens().weight
    if emb.device.type != "meta":
        return emb
    name = next((n for n, p in target.model.named_parameters() if p is emb), "model.embed_tokens.weight")
    from safetensors import safe_open

    files = sorted(Path(target.path).glob("*.safetensors")) if target.path is not None else []
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            keys = list(sf.keys())
            key = name if name in keys else next((k for k in keys if k.endswith("embed_tokens.weight")), None)
            if key is not None:
                w = sf.get_tensor(key).to(emb.dtype)
                if tuple(w.shape) != tuple(emb.shape):
                    raise TargetError(f"{f}: {key} has shape {tuple(w.shape)}, the config implies {tuple(emb.shape)}"
                                      "; the folder's weights and config.json disagree")
                return w
    raise TargetError(f"no token embedding ({name}) in the safetensors files of {target.path}: the draft needs the "
                      "target's embeddings; pass the target's own HF folder")


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


def identity_of(model: PreTrainedModel, fingerprint: str, name: str = "") -> TargetIdentity:
    cfg = model.config
    cfg = text_config(cfg)
    return TargetIdentity(
        architecture=(model.config.architectures or [type(model).__name__])[0],
        model_type=cfg.model_type,
        num_layers=int(cfg.num_hidden_layers),
        hidden_size=int(cfg.hidden_size),
        vocab_size=int(cfg.vocab_size),
        fingerprint=fingerprint,
        name=name,
    )


def _cache_entry_ok(folder: Path, fp: str, gguf: Path | None = None) -> bool:
    """Whether a converted-GGUF cache folder can be used: a config.json and an eyas_source.json that records
    this GGUF's fingerprint, and (given the GGUF) a config.json that carries what the GGUF's metadata fixes
    (gguf_overrides: RoPE scaling, head size, window...). A folder without them (an older eyas's, a torn or
    hand-edited record) is a stale cache entry: the caller converts the GGUF again rather than trusting or
    refusing it."""
    if not (folder / "config.json").exists():
        return False
    try:
        meta = json.loads((folder / "eyas_source.json").read_text())
        saved = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(meta, dict) or meta.get("fingerprint") != fp or not isinstance(saved, dict):
        return False
    return gguf is None or overrides_hold(saved, gguf_overrides(gguf))


def _meta_model(folder: Path, dtype: torch.dtype, trust_remote_code: bool) -> PreTrainedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    if (folder / "generation_config.json").is_file():  # its eos ids are end-of-turn tokens (end_token_ids)
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model


def load_target(spec: str = DEFAULT_TARGET, dtype: str | torch.dtype = "fp32", device: str = "cpu",
                trust_remote_code: bool = False, load_weights: bool = True) -> Target:
    """`spec`: a bundled name (smollm2-135m), a HF model folder, or a .gguf file. load_weights=False builds the model
    on the meta device from its config (tokenizer, identity, generation config and layout, no weights): for a
    caller that runs the target elsewhere (`datagen --engine vllm`, a target bigger than this machine)."""
    hub_offline()  # before transformers reads anything: every asset is local
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    torch_dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    dev = resolve_device(device)
    gguf = gguf_of(spec)
    if gguf is not None:
        fp = file_fingerprint([gguf])
        folder = cache_dir() / "targets" / f"{gguf.stem}-{fp.split(':')[1][:12]}"
        if not _cache_entry_ok(folder, fp, gguf):  # absent, or stale: converted again (atomically replaced)
            from ..native.gguf_file import read_gguf_tensors

            read_gguf_tensors(gguf)  # a truncated or foreign file: one clear error before transformers reads it
            with during(f"converting {gguf.name} to a safetensors folder (first use only; minutes on a CPU)"):
                convert_gguf(gguf, folder)
        name = spec if spec in BUNDLED else gguf.name
        fix = f"the converted copy of {gguf.name} is damaged: delete {folder} and rerun (eyas converts it again)"
    else:
        folder = hf_folder(spec)
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
    model: PreTrainedModel
    try:
        if load_weights:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype,
                                                         trust_remote_code=trust_remote_code, use_safetensors=True)
        else:
            model = _meta_model(folder, torch_dtype, trust_remote_code)
            dev = torch.device("meta")
    except Exception as e:  # noqa: BLE001 - a config transformers cannot build a model from (no model_type, an
        # unknown architecture, wrong field types, weights of other shapes): the user's folder, not a bug in eyas
        raise TargetError(f"transformers could not load a causal LM from {folder} ({type(e).__name__}: "
                          f"{_first_line(e)}); {fix}") from e
    model.to(dev).eval()  # type: ignore[arg-type]  # transformers: @wraps(nn.Module.to) types it unbound
    model.requires_grad_(False)
    ident = identity_of(model, fp, name)
    return Target(model=model, tokenizer=tok, identity=ident, source=spec, path=folder,
                  load_seconds=time.perf_counter() - t0, gguf=gguf)
