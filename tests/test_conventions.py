"""eyas/conventions.py: each engine's aux-id convention round-trips, and the tables match DESIGN.md's facts."""

from __future__ import annotations

import pytest

from eyas.conventions import (
    CONVENTIONS,
    ENGINES,
    default_aux_indices,
    default_ids,
    engine_ids_table,
    from_engine_ids,
    read_ids,
    sglang_config_ids,
    speculators_config_ids,
    to_engine_ids,
    vllm_config_ids,
)
from eyas.engine_views import engine_views
from eyas.errors import LayoutError

L = 30  # SmolLM2-135M: the EAGLE-3 default is stream [2, 15, 27]


@pytest.mark.parametrize("engine", sorted(CONVENTIONS))
def test_every_expressible_layout_round_trips(engine):
    lo, hi = CONVENTIONS[engine].stream_range(L)
    for stream in ([lo, (lo + hi) // 2, hi], default_aux_indices(L), [lo + 1]):
        assert from_engine_ids(to_engine_ids(stream, engine, L), engine, L) == stream
    with pytest.raises(LayoutError):
        to_engine_ids([lo - 1], engine, L)
    with pytest.raises(LayoutError):
        to_engine_ids([hi + 1], engine, L)


def test_default_aux_indices_small_targets_are_distinct():
    # [2, L//2, L-3] repeats a stream below 7 layers: early/middle/late inner streams instead
    assert default_aux_indices(4) == [1, 2, 3]
    assert default_aux_indices(5) == [1, 2, 4]
    assert default_aux_indices(6) == [1, 3, 5]
    assert default_aux_indices(7) == [2, 3, 4]
    with pytest.raises(LayoutError, match="at least 1 decoder layer"):
        default_aux_indices(0)


@pytest.mark.parametrize("layers", range(1, 65))
def test_default_aux_indices_sweep(layers):
    idx = default_aux_indices(layers)
    assert idx == sorted(set(idx)) and len(idx) == min(3, max(1, layers - 1))
    assert all(0 <= k <= layers for k in idx)
    if layers >= 4:  # every engine (SGLang's output-of ids too) can express them
        assert all(1 <= k <= layers - 1 for k in idx)
        for engine in CONVENTIONS:
            assert from_engine_ids(to_engine_ids(idx, engine, layers), engine, layers) == idx
    if layers >= 7:
        assert idx == [2, layers // 2, layers - 3]


def test_tables_match_design_facts_for_30_layers():
    assert default_aux_indices(L) == [2, 15, 27]
    table = engine_ids_table([2, 15, 27], L)
    assert set(table) == set(ENGINES)
    assert table["sglang"] == [1, 14, 26]  # output-of: stream - 1
    assert table["vllm"] == table["speculators"] == table["eagle"] == table["eyas"] == [2, 15, 27]  # input-of
    assert default_ids("sglang", L) == default_ids("specforge", L) == [1, 14, 26]  # [1, L//2-1, L-4]
    assert default_ids("vllm", L) == [2, 15, 27]
    assert {e: c.meaning for e, c in CONVENTIONS.items()} == {
        "eyas": "input-of", "eagle": "input-of", "sglang": "output-of", "specforge": "output-of",
        "vllm": "input-of", "speculators": "input-of"}
    # SGLang cannot express the embedding or the final state; vLLM can
    assert CONVENTIONS["sglang"].stream_range(L) == (1, 29) and CONVENTIONS["vllm"].stream_range(L) == (0, 30)


def test_written_ids_read_back_as_each_engine_reads_them():
    stream = [2, 15, 27]
    cfg = {**sglang_config_ids(stream, L), **vllm_config_ids(stream, L)}
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27] and cfg["eagle_aux_layer_semantics"] == "vllm"
    for eng in ("sglang", "vllm"):
        assert [v.indices for v in engine_views(cfg, eng, L)] == [stream]
    found = read_ids({**speculators_config_ids(stream, L)})
    assert found.top == [2, 15, 27] and found.eagle_config is None


def test_the_off_by_one_traps():
    # vLLM falls back to SGLang's eagle_config ids as-is: one layer early
    views = engine_views(sglang_config_ids([2, 15, 27], L), "vllm", L)
    assert [2, 15, 27] in [v.indices for v in views] and [1, 14, 26] in [v.indices for v in views]
    # vLLM's "sglang" semantics adds 1 to the top-level ids
    (v,) = engine_views({"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}, "vllm", L, semantics="sglang")
    assert v.indices == [2, 15, 27]
