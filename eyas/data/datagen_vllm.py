"""`datagen --engine vllm`: vLLM runs the target in a worker (eyas/vllm), regenerating replies and returning
the hidden states eyas's capture would (stored by the same checks, eyas/data/capture.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..layout import Layout
from ..target.load import Target
from ..vllm.env import VllmError
from ..vllm.session import VllmSession, aux_ids
from .capture import NormAccumulator, length_batches, store_batch
from .datagen_config import DatagenConfig, DatagenError, vllm_engine_args
from .shards import Sample

_VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class LazySession:
    """The vLLM worker, started by the first command sent to it."""

    def __init__(self, start: Callable[[], VllmSession]):
        self.start = start
        self.session: VllmSession | None = None

    def call(self, op: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        if self.session is None:
            self.session = self.start()
        return self.session.call(op, timeout)

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


def start_vllm(py: Path, cfg: DatagenConfig, target: Target, layout: Layout, out: Path,
                log: Callable[[str], None]) -> VllmSession:
    """Start the vLLM worker on the target's HF folder, capturing the layout's stream indices and the final
    pre-norm state (stream L) through extract_hidden_states; refuses a vLLM whose model differs in shape."""
    if target.path is None:
        raise DatagenError(f"--engine vllm needs the target as a HF folder; {cfg.target} has none")
    work = out / ".vllm"
    for f in (work / "hidden-states").glob("*"):  # a killed run's leftovers
        f.unlink()
    req = {"model": str(target.path), "dtype": _VLLM_DTYPES[cfg.target_dtype],
           "max_model_len": cfg.max_len + 16,  # a row of max_len tokens still gets its one generated token
           "aux_ids": aux_ids(layout.aux_indices, target.num_layers), "seed": cfg.seed,
           "generator": cfg.vllm_generator, "engine_args": vllm_engine_args(cfg)}
    log(f"starting vLLM ({py}) on {target.path} with eagle_aux_hidden_state_layer_ids {req['aux_ids']} "
        "(= eyas stream indices; the last is the final pre-norm state)")
    session = VllmSession(py, req, work, log=lambda line: None)
    info = session.info
    if (info["num_layers"], info["hidden_size"]) != (target.num_layers, target.hidden_size):
        session.close()
        raise DatagenError(f"vLLM loaded a model of {info['num_layers']} layers x {info['hidden_size']}, eyas's "
                           f"target has {target.num_layers} x {target.hidden_size}: pass the same model to both")
    log(f"vLLM {info['vllm']} ready on {info['device']} in {info['load_seconds']} s (replies on a "
        f"{info['generator']} engine)")
    return session


@torch.no_grad()
def capture_samples_vllm(session: VllmSession, items: list[tuple[int, torch.Tensor, torch.Tensor]],
                         layout: Layout, num_layers: int, hidden: int, store_dtype: torch.dtype, capture_tokens: int,
                         work: Path, norms: NormAccumulator | None = None,
                         on_batch: Callable[[int, int], None] | None = None) -> list[Sample]:
    """capture_samples through vLLM: each batch of at most capture_tokens tokens is prefilled by the worker,
    whose extract_hidden_states connector returns every position's states at aux_ids (ascending); they are put
    in the layout's order (aux) and stream L (final), then checked and stored exactly as eyas's own capture."""
    from safetensors.torch import load_file

    ids = aux_ids(layout.aux_indices, num_layers)
    pick = [ids.index(k) for k in layout.aux_indices]
    out: list[Sample | None] = [None] * len(items)
    for batch in length_batches([len(it[1]) for it in items], 1 << 30, capture_tokens):
        file = work / "capture.safetensors"
        r = session.call({"op": "capture", "rows": [items[i][1].tolist() for i in batch], "file": str(file)})
        t = load_file(r["file"])
        file.unlink()
        hs = t["hidden_states"]  # [N, len(ids), H]
        if hs.shape[1:] != (len(ids), hidden) or t["lengths"].tolist() != [len(items[i][1]) for i in batch]:
            raise VllmError(f"the vLLM worker returned states of shape {tuple(hs.shape)} for rows of lengths "
                            f"{t['lengths'].tolist()}; expected [tokens, {len(ids)}, {hidden}] for "
                            f"{[len(items[i][1]) for i in batch]}")
        aux = hs[:, pick].reshape(hs.shape[0], -1)
        final = hs[:, ids.index(num_layers)]
        store_batch(items, batch, aux, final, layout, hidden, store_dtype, norms, out)
        if on_batch:
            on_batch(len(batch), int(hs.shape[0]))
    return [s for s in out if s is not None]
