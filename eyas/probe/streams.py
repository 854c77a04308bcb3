"""The target's streams a draft is scored on: the serving-path forward (Serving: the engine's forward when the family
has one), the datagen capture path, and the fresh streams and step-0 labels of each sample (capture_streams)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..draft import Eagle3Draft
from ..train.ttt import target_labels
from .samples import EvalSample

if TYPE_CHECKING:
    from ..engine.forward import TargetModel


class Serving:
    """The serving-path forward: eyas.engine.forward.TargetModel (what the engine runs) when the family has one,
    else the HF forward with hooks (the only path those families have)."""

    def __init__(self, target, weights: str = "auto"):
        from ..engine.weights import engine_model
        from ..target.family import engine_covers

        self.target = target
        self.L = target.num_layers
        # only the family decides the fallback: any other refusal (a --weights mode that cannot apply) is the
        # user's to see, not a silent switch to another forward
        if engine_covers(target.identity.model_type):
            self.fwd: TargetModel | None = engine_model(target, weights)
            mode = "native GGUF weights" if self.fwd.native is not None else "fp32 weights"
            self.path = f"eyas.engine.forward.TargetModel (the engine's forward, {mode})"
            self.short = "engine forward"
        else:
            self.fwd = None
            self.path = f"HF forward + hooks (no engine forward for the {target.identity.model_type} family)"
            self.short = "HF forward + hooks"

    @torch.no_grad()
    def streams(self, input_ids: torch.Tensor, indices: Sequence[int]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """input_ids [S] -> ({k: [S, H]} for each wanted stream index, final pre-norm [S, H]); one forward."""
        want = sorted(set(int(k) for k in indices) - {self.L})
        ids = input_ids.reshape(1, -1).to(self.target.device)
        H = self.target.hidden_size
        if self.fwd is not None:
            cap = self.fwd.capture(ids, want)
        else:
            from ..target.capture import capture

            cap = capture(self.target.model, ids, want)
        parts = {k: cap.aux[0, :, i * H:(i + 1) * H] for i, k in enumerate(want)} if want else {}
        final = cap.final_prenorm[0]
        parts[self.L] = final
        return parts, final


@torch.no_grad()
def capture_path_streams(target, input_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """input_ids [S] -> {k: [S, H]} for every stream 0..L through datagen's capture path (eyas.target.capture:
    the HF forward with hooks, in the target's dtype). The data-layout check compares stored slices in the
    numerics they were captured in: a serving path on other numerics (native 4-bit weights with 8-bit
    activations drift ~1-3% by the last layers) must not read as a wiring fault."""
    from ..target.capture import capture

    L, H = target.num_layers, target.hidden_size
    want = list(range(L))
    cap = capture(target.model, input_ids.reshape(1, -1).to(target.device), want)
    out = {k: cap.aux[0, :, i * H:(i + 1) * H] for i, k in enumerate(want)}
    out[L] = cap.final_prenorm[0]
    return out


@dataclass
class FreshStreams:
    """One sample's streams captured now (not read from shards), with the step-0 labels the final state gives."""

    streams: dict[int, torch.Tensor]  # k -> [S, H]
    final: torch.Tensor  # [S, H] pre-norm
    labels: tuple[torch.Tensor, torch.Tensor]  # (probs [1,S,Vd], argmax [1,S]) from the fresh final


def capture_streams(serving: Serving, draft: Eagle3Draft, target, samples: list[EvalSample],
                    indices: set[int]) -> list[FreshStreams]:
    """One serving-path forward per sample capturing `indices`."""
    out = []
    ids_map = draft.target_token_ids()
    for s in samples:
        streams, final = serving.streams(s.input_ids, sorted(indices))
        labels = target_labels(final[None].float(), target.final_norm(), target.lm_head(), ids_map)
        out.append(FreshStreams(streams, final, labels))
    return out
