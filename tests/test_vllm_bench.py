"""vLLM inside `eyas bench` (eyas/bench/vllm_peer.py, eyas/vllm/generate_worker.py).

The vllm-marked test drives the real vLLM (its own environment, `make vllm`) on the bundled target and the
shipped draft exported by eyas, and skips when no vLLM python is found; the missing-vLLM error needs no vLLM."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from eyas.cli import app

K = 3


@pytest.mark.vllm
@pytest.mark.integration
def test_bench_vllm_matches_eyas_chain_and_plain(vllm_py, smollm2, tmp_path):
    """On 2 MT-bench prompts, vLLM's per-position accepted counts for k=3 equal eyas chain steps 3 (both fp32)
    and both vLLM methods' tokens equal eyas plain greedy on the fp32 weights, read straight from the rows."""
    from eyas.bench.config import BenchConfig
    from eyas.bench.run import run_bench
    from eyas.engine.params import TreeSettings

    cfg = BenchConfig(bench="mt-bench", limit=2, max_new_tokens=32, methods=["plain", "chain", "vllm", "vllm-eagle3"],
                      tree=TreeSettings(steps=K, min_prob=0.0), vllm_k=K, weights="fp32", out=str(tmp_path / "bench"),
                      vllm_python=str(vllm_py))
    res = run_bench(cfg, target=smollm2, progress=False, show=False)
    rows = res["rows"]
    by = {(r["prompt"], r["method"]): r for r in rows}
    prompts = [p["id"] for p in res["prompts"]]
    assert len(prompts) == 2
    for p in prompts:
        plain = by[(p, "plain")]["token_ids"]
        assert by[(p, "vllm")]["token_ids"] == plain
        assert by[(p, "vllm-eagle3")]["token_ids"] == plain
        assert by[(p, "vllm")]["same_as_ref"] and by[(p, "vllm-eagle3")]["same_as_ref"]
    chain = [by[(p, "chain")]["stats"] for p in prompts]
    spec = [by[(p, "vllm-eagle3")]["vllm"] for p in prompts]
    eyas_per_depth = [sum(s["accepted_per_depth"][i] for s in chain) for i in range(K)]
    vllm_per_pos = [sum(s["accepted_per_pos"][i] for s in spec) for i in range(K)]
    assert vllm_per_pos == eyas_per_depth
    assert sum(s["drafts"] for s in spec) == sum(s["rounds"] for s in chain)
    assert sum(vllm_per_pos) > 0  # the draft really proposed and was accepted
    info = res["vllm"]
    assert info["k"] == K and info["version"]
    assert info["wiring"]["verdict"] == "equal"
    assert info["reference"]["chain"].startswith("this run's chain rows")  # fp32, steps 3, no min-prob: reused
    assert info["eagle3_vs_vllm_plain"] == {"identical": 2, "compared": 2}
    assert res["summary"]["methods"]["vllm-eagle3"]["accept_per_depth"][0] > 0


def test_bench_vllm_missing_python_is_one_line(tmp_path):
    """No vLLM at --vllm-python: one error line naming `make vllm`, exit 2, before the target loads."""
    out = tmp_path / "bench"
    r = CliRunner().invoke(app, ["bench", "--methods", "plain,vllm-eagle3", "--limit", "1", "--max-new-tokens", "4",
                                 "--vllm-python", str(tmp_path / "nowhere" / "python"), "--out", str(out)])
    assert r.exit_code == 2, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.output
    assert "make vllm" in lines[0] and "--vllm-python" in lines[0]
    assert "Traceback" not in r.output
    assert not out.exists()  # nothing ran


def test_wiring_verdicts():
    """equal / close (within 3%) / far, from pooled per-position counts; far names the causes, target weights and
    dtype first when vLLM's plain greedy already differs from eyas fp32 plain."""
    from eyas.bench.rows import first_diff as rows_first_diff
    from eyas.bench.vllm_peer import first_diff, wiring, wiring_line

    def rows(per_pos: list[int], drafts: int, plain_same: bool = True) -> list[dict]:
        return [{"prompt": "p", "method": "vllm-eagle3", "vllm": {"accepted_per_pos": per_pos, "drafts": drafts}},
                {"prompt": "p", "method": "vllm", "same_as_ref": plain_same}]

    ref = {"chain": {"p": {"accepted_per_depth": [200, 100, 50], "rounds": 400}}}
    assert wiring(rows([200, 100, 50], 400), ref, 3)["verdict"] == "equal"
    w = wiring(rows([203, 99, 50], 401), ref, 3)
    assert w["verdict"] == "close" and "close (largest difference 1.5%)" in wiring_line(w)
    w = wiring(rows([20, 2, 0], 400), ref, 3)
    assert w["verdict"] == "far" and w["likely_causes"][0].startswith("aux ids off by one")
    assert "d2t" in wiring_line(w) and "'eagle'" in wiring_line(w)
    w = wiring(rows([20, 2, 0], 400, plain_same=False), ref, 3)
    assert w["likely_causes"][0].startswith("target weights differ") and "already differs" in wiring_line(w)
    for a, b in (([1, 2], [1, 2]), ([1, 2], [1, 3]), ([1], [1, 2]), ([], [4]), ([5, 2], [1])):
        assert first_diff(a, b) == rows_first_diff(a, b)
