"""datagen's capture: hidden states of tokenized rows, batched by similar length, checked and sliced into
Samples (eyas runs the target here; eyas/data/datagen_vllm.py captures through vLLM with the same checks)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..layout import Layout
from ..target.capture import capture
from ..target.load import Target
from .datagen_config import DatagenError
from .shards import Sample

# ---- batching ----------------------------------------------------------------------------------------

def length_batches(lengths: list[int], max_batch: int, token_budget: int) -> list[list[int]]:
    """Indices grouped by similar length (ascending) so padding stays small; each batch holds at most
    max_batch items and at most token_budget padded tokens (a single over-long item forms its own batch)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1 > max_batch or (len(cur) + 1) * lengths[i] > token_budget):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


# ---- capture -----------------------------------------------------------------------------------------

@dataclass
class NormAccumulator:
    """Running sums of per-token L2 norms per captured stream index (keys str(k) and "final")."""
    sums: dict[str, float] = field(default_factory=dict)
    tokens: int = 0

    def means(self) -> dict[str, float]:
        return {k: round(v / max(self.tokens, 1), 4) for k, v in self.sums.items()}


@torch.no_grad()
def capture_samples(target: Target, items: list[tuple[int, torch.Tensor, torch.Tensor]], layout: Layout,
                    store_dtype: torch.dtype, capture_tokens: int, norms: NormAccumulator | None = None,
                    on_batch: Callable[[int, int], None] | None = None) -> list[Sample]:
    """items: (row_id, input_ids [S], loss_mask [S]). Batches by similar length with right padding and an
    attention mask (causal attention: real tokens never see the padding on their right), slices each row's
    real tokens and returns Samples in the order of `items`, features cast to store_dtype on the CPU."""
    dev = target.device
    H = target.hidden_size
    out: list[Sample | None] = [None] * len(items)
    for batch in length_batches([len(it[1]) for it in items], 1 << 30, capture_tokens):
        S = max(len(items[i][1]) for i in batch)
        ids = torch.zeros((len(batch), S), dtype=torch.long)
        am = torch.zeros((len(batch), S), dtype=torch.long)
        for b, i in enumerate(batch):
            ids[b, :len(items[i][1])] = items[i][1]
            am[b, :len(items[i][1])] = 1
        cap = capture(target.model, ids.to(dev), layout, attention_mask=am.to(dev), logits="none")
        real = am.to(dev).bool()  # [B, S]
        # [N, nA*H], [N, H] real tokens only
        store_batch(items, batch, cap.aux[real], cap.final_prenorm[real], layout, H, store_dtype, norms, out)
        if on_batch:
            on_batch(len(batch), int(am.sum()))
    return [s for s in out if s is not None]


def store_batch(items: list[tuple[int, torch.Tensor, torch.Tensor]], batch: list[int], aux: torch.Tensor,
                 final: torch.Tensor, layout: Layout, H: int, store_dtype: torch.dtype,
                 norms: NormAccumulator | None, out: list[Sample | None]) -> None:
    """One captured batch (aux [N, nA*H] in layout order, final [N, H], the batch's rows back to back) checked,
    counted into the norms and sliced into Samples at out[i]: shared by eyas's capture and vLLM's."""
    nA = layout.num_aux
    if not (torch.isfinite(aux).all() and torch.isfinite(final).all()):
        raise DatagenError(f"the target produced non-finite hidden states for rows "
                           f"{[items[i][0] for i in batch]}; run it in fp32 (--target-dtype fp32)")
    if norms is not None:
        per = aux.float().view(-1, nA, H).norm(dim=-1).sum(0).tolist()  # [nA]
        for k, v in zip(layout.aux_indices, per, strict=True):
            norms.sums[str(k)] = norms.sums.get(str(k), 0.0) + v
        norms.sums["final"] = norms.sums.get("final", 0.0) + final.float().norm(dim=-1).sum().item()
        norms.tokens += aux.shape[0]
    aux_s, final_s = aux.to(store_dtype).cpu(), final.to(store_dtype).cpu()
    if not (torch.isfinite(aux_s).all() and torch.isfinite(final_s).all()):
        peak = max(aux.abs().max().item(), final.abs().max().item())
        raise DatagenError(f"features overflow the stored dtype {store_dtype} (max |x| = {peak:.0f}; the "
                           "target has massive activations): store them with --dtype bf16 or fp32")
    off = 0
    for i in batch:
        n = len(items[i][1])
        row_id, input_ids, loss_mask = items[i]
        out[i] = Sample(row_id=row_id, input_ids=input_ids, loss_mask=loss_mask,
                        aux=aux_s[off:off + n], final=final_s[off:off + n])
        off += n

