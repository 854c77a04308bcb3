"""Capture uses hooks on the decoder layers, never `output_hidden_states` ordering: HF's last entry is
the post-norm state, which is not stream index L."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..layout import Layout
from .family import TargetError

if TYPE_CHECKING:  # transformers loads with the target (eyas.target.load), after hub_offline()
    from transformers import PreTrainedModel


def decoder_parts(model: PreTrainedModel) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
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
def stream_hooks(model: PreTrainedModel, indices: list[int]):
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
def capture(model: PreTrainedModel, input_ids: torch.Tensor, layout: Layout | list[int],
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
def stream_norms(model: PreTrainedModel, input_ids_list: list[torch.Tensor], indices: list[int]) -> dict[str, float]:
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
