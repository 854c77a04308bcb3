"""vLLM inside `eyas bench`: methods `vllm` (vLLM greedy) and `vllm-eagle3` (vLLM greedy with this run's draft,
exported by eyas's own `export --format vllm` into the run folder), on the same prompt token ids.

vLLM runs in its own environment (eyas/vllm/env.py): one worker process per method (eyas/vllm/generate_worker.py)
loads vLLM once, warms up, then generates the prompts one at a time (batch 1, as eyas's engine), each timed around
its generate call with the prefill included, as bench times eyas's methods. So vLLM's rows are not interleaved
with eyas's: they run after them, in the same bench.

What vLLM's tokens are compared with: vLLM loads the target's HF folder, i.e. the fp32 weights (a bundled GGUF
dequantized once by eyas), while eyas's methods run the GGUF's native 4-bit weights under --weights auto. So
the vllm methods' "identical" is always against eyas plain greedy on the fp32 weights (--weights fp32): taken
from this run's plain rows when they ran fp32, computed here (untimed) otherwise. The wiring line compares
vLLM's per-position accepted counts with eyas's chain of the same k on the same fp32 weights, fp32 draft and no
--min-prob (vLLM has none): reused from this run's chain rows when they are exactly that, computed otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..draft import DraftCheckpoint
from ..errors import EyasError
from ..target.load import Target
from ..vllm.env import run_worker, vllm_python, vllm_version
from .prompts import BenchPrompt

VLLM_METHODS = ("vllm", "vllm-eagle3")
SPEC_METHOD = "eagle3"  # vLLM's name; "eagle" would feed the draft the final hidden state, not the aux concat
CLOSE = 0.03  # per-position counts within 3% of eyas's: "close" (e.g. a prompt where the targets' numerics part)
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
WARMUP_TOKENS = 16
FAR_CAUSES = ("aux ids off by one between conventions (the export's eagle_aux_hidden_state_layer_ids vs the "
              "layout's stream indices)", "the d2t map dropped (draft ids read as target ids)",
              f"the wrong method name (vLLM 'eagle' instead of '{SPEC_METHOD}' never captures the aux states)",
              "target weights differ (eyas native 4-bit vs vLLM's fp32 folder)", "dtype (bf16/fp16 vs fp32)")


class VllmBenchError(EyasError):
    pass


def vllm_methods(methods: list[str]) -> list[str]:
    return [m for m in methods if m in VLLM_METHODS]


def check_vllm(methods: list[str], given: str | None) -> Path | None:
    """vLLM's python when a vllm method is asked for, found before anything loads (a one-line VllmError naming
    `make vllm` when there is none); None when no vllm method runs."""
    asked = vllm_methods(methods)
    if not asked:
        return None
    return vllm_python(given, f"bench --methods {','.join(asked)}")


def _strip_end(ids: list[int], end_ids: list[int]) -> tuple[list[int], str]:
    return (ids[:-1], "stop") if ids and ids[-1] in end_ids else (ids, "length")


def export_for_vllm(draft: DraftCheckpoint, target: Target, k: int, dtype: str, out: Path) -> Path:
    """The run's draft in vLLM's format (eyas export --format vllm), into the run folder."""
    from ..interop.export import LaunchParams, export_draft

    res = export_draft(draft, "vllm", out, dtype=dtype, target=str(target.path), launch=LaunchParams(steps=k),
                       command="eyas bench (vllm-eagle3 export)")
    return res.path


def run_vllm_method(py: Path, method: str, target: Target, draft_dir: Path | None, k: int, dtype: str,
                    ids: list[list[int]], max_new_tokens: int, end_ids: list[int], out: Path,
                    say: Callable[[str], None]) -> dict[str, Any]:
    """One worker run: vLLM loads the target (and draft), then generates every prompt in `ids`."""
    longest = max((len(x) for x in ids), default=1)
    assert target.path is not None  # run_vllm_peers refuses a target without a HF folder
    request = {
        "model": str(Path(target.path).resolve()), "draft": str(draft_dir.resolve()) if draft_dir else None,
        "k": k if draft_dir else 0,
        "method": SPEC_METHOD, "prompts": ids, "max_new_tokens": max_new_tokens, "stop_token_ids": end_ids,
        "dtype": DTYPES[dtype], "max_model_len": longest + max_new_tokens + k + 16, "seed": 0,
        "warmup_tokens": WARMUP_TOKENS, "enforce_eager": True,
    }
    work = out / "vllm" / method
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "worker.log", "w") as log:
        def line(s: str) -> None:
            log.write(s + "\n")
            if s.startswith("vllm worker:"):
                say(f"bench: {method}: {s[len('vllm worker: '):]}")
        # a generous bound: loading takes a minute or two on a small CPU, decoding runs >= ~5 tok/s
        timeout = 900 + len(ids) * (max_new_tokens / 5 + 10)
        t0 = time.perf_counter()
        res = run_worker(py, "generate_worker.py", request, work, timeout=timeout, log=line)
    res["wall_seconds"] = time.perf_counter() - t0
    if len(res["outputs"]) != len(ids):
        raise VllmBenchError(f"the vLLM worker returned {len(res['outputs'])} outputs for {len(ids)} prompts "
                             f"(see {work / 'worker.log'})")
    return res


def vllm_outputs(prompts: list[BenchPrompt], method: str, res: dict[str, Any], end_ids: list[int]) -> list[dict]:
    """Per prompt, what bench makes a row of (eyas.bench.methods.Output's fields) and vLLM's spec-decode counters.
    target_forwards follows eyas's count: the prefill plus one per decode step (vLLM: one per draft verified)."""
    outs = []
    for p, o in zip(prompts, res["outputs"], strict=True):
        ids, finish = _strip_end(o["token_ids"], end_ids)
        generated = len(ids) + (finish == "stop")
        spec = o.get("spec")
        outs.append({"prompt": p, "method": method, "token_ids": ids, "seconds": o["seconds"],
                     "target_forwards": spec["drafts"] + 1 if spec else generated, "finish": finish, "vllm": spec})
    return outs


def first_diff(a: list[int], b: list[int]) -> int | None:
    """First position where two token lists differ (the shorter length if one is a prefix); None if equal
    (eyas.bench.rows.first_diff's rule; rows imports this module, so not imported from there)."""
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def accept_rates(rows: list[dict[str, Any]]) -> list[float | None] | None:
    """Conditional acceptance per draft position from vLLM's counters pooled over rows: position i accepted
    given position i-1 was (position 0: given a draft), the eyas accept-per-depth definition for a chain.
    None unless the rows carry vLLM's spec-decode counters."""
    specs = [r["vllm"] for r in rows if r.get("vllm")]
    if not specs:
        return None
    drafts = sum(s["drafts"] for s in specs)
    per = [sum(s["accepted_per_pos"][i] for s in specs) for i in range(len(specs[0]["accepted_per_pos"]))]
    prev = [drafts, *per[:-1]]
    return [a / b if b else None for a, b in zip(per, prev, strict=True)]


# ---- the eyas fp32 reference ---------------------------------------------------------------------

def vllm_k(cfg) -> int:
    k = chain_knobs(cfg)["steps"] if cfg.vllm_k is None else cfg.vllm_k
    if k < 1:
        raise VllmBenchError(f"--vllm-k {k}: vLLM's num_speculative_tokens must be >= 1")
    return k


def reference_specs(cfg) -> list:
    """The eyas engines the vllm methods are compared with (checked and loaded before anything runs): plain on
    the fp32 weights, and for vllm-eagle3 chain-k with the fp32 draft and no --min-prob."""
    from ..engine.params import TreeSettings

    if not vllm_methods(cfg.methods):
        return []
    specs = [TreeSettings().spec("plain", None, weights="fp32")]
    if "vllm-eagle3" in cfg.methods:
        chain = TreeSettings(steps=vllm_k(cfg), lookup=0, min_prob=0.0)
        specs.append(chain.spec("chain", None, weights="fp32", draft_weights="fp32"))
    return specs


def chain_knobs(cfg) -> dict[str, Any]:
    """The bench's chain as it runs: the run's knobs, the device's defaults for the rest."""
    return cfg.tree.resolved("chain", cfg.device)


def _reusable(runner, method: str, cfg, k: int) -> bool:
    """Whether this run's own rows of `method` are the reference: fp32 target; chain also fp32 draft, k steps,
    no --min-prob."""
    e = getattr(runner, "engine", None)
    if e is None or e.weights != "fp32":
        return False
    if method == "chain":
        chain = chain_knobs(cfg)
        return e.draft_weights == "fp32" and chain["steps"] == k and not chain["min_prob"]
    return True


def fp32_reference(cfg, target: Target, draft: DraftCheckpoint | None, end_ids: list[int],
                   prompts: list[BenchPrompt], ids: list[list[int]], runners: dict, rows: list[dict[str, Any]],
                   k: int, chain: bool, say: Callable[[str], None]) -> dict[str, Any]:
    """Per prompt: eyas plain greedy token ids on the fp32 weights, and (chain) eyas chain-k's per-depth accepted
    counts and rounds on the same weights: from this run's rows when they qualify, else computed (untimed)."""
    from ..engine.load import EngineParts, make_engine
    from ..engine.params import SamplingParams

    ref: dict[str, Any] = {"plain": {}, "chain": {} if chain else None}
    how = {}
    for method in ("plain", "chain") if chain else ("plain",):
        if method in runners and _reusable(runners[method], method, cfg, k):
            how[method] = f"this run's {method} rows (fp32)"
            for r in rows:
                if r["method"] == method:
                    ref[method][r["prompt"]] = _ref_entry(r["token_ids"], r.get("stats"))
            continue
        how[method] = (f"eyas {method}" + (f" steps {k}, fp32 draft, no --min-prob" if method == "chain" else "")
                       + " --weights fp32, run untimed for this comparison")
        say(f"bench: eyas {method} on the fp32 weights (the reference for the vllm methods)")
        spec = next(s for s in reference_specs(cfg) if s.method == method)
        engine = make_engine(EngineParts(target, draft, None), spec)
        for p, x in zip(prompts, ids, strict=True):
            res = engine.generate(x, SamplingParams(temperature=0.0, max_new_tokens=cfg.max_new_tokens))
            out, _ = _strip_end(list(res.token_ids), end_ids)
            s = res.stats
            ref[method][p.id] = _ref_entry(out, {"rounds": s.rounds, "accepted_per_depth": s.accepted_per_depth})
    ref["how"] = how
    return ref


def _ref_entry(token_ids: list[int], stats: dict | None) -> dict[str, Any]:
    e: dict[str, Any] = {"token_ids": token_ids}
    if stats:
        e["rounds"] = stats["rounds"]
        e["accepted_per_depth"] = list(stats["accepted_per_depth"])
    return e


def mark_vllm(rows: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    """same_as_ref / first_diff of each vllm row against eyas fp32 plain (the weights vLLM runs)."""
    for r in rows:
        if r["method"] in VLLM_METHODS and r["prompt"] in ref["plain"]:
            d = first_diff(r["token_ids"], ref["plain"][r["prompt"]]["token_ids"])
            r["same_as_ref"] = d is None
            r["first_diff"] = d


# ---- the wiring line -----------------------------------------------------------------------------

def wiring(rows: list[dict[str, Any]], ref: dict[str, Any], k: int) -> dict[str, Any] | None:
    """vLLM's per-position accepted counts vs eyas chain-k's per-depth accepted counts, pooled over the prompts
    both ran: equal, close (each within CLOSE of eyas's) or far, with the likely causes when far."""
    spec_rows = [r for r in rows if r["method"] == "vllm-eagle3" and r.get("vllm")]
    chain = ref.get("chain") or {}
    both = [r for r in spec_rows if r["prompt"] in chain and "accepted_per_depth" in chain[r["prompt"]]]
    if not both:
        return None
    v = [sum(r["vllm"]["accepted_per_pos"][i] for r in both) for i in range(k)]
    e = [sum((chain[r["prompt"]]["accepted_per_depth"] + [0] * k)[i] for r in both) for i in range(k)]
    vd = sum(r["vllm"]["drafts"] for r in both)
    ed = sum(chain[r["prompt"]]["rounds"] for r in both)
    off = max([abs(a - b) / max(b, 1) for a, b in zip(v + [vd], e + [ed], strict=True)])
    verdict = "equal" if v == e and vd == ed else "close" if off <= CLOSE else "far"
    differ = [r["prompt"] for r in rows if r["method"] == "vllm" and r.get("same_as_ref") is False]
    w: dict[str, Any] = {"k": k, "prompts": len(both), "vllm_accepted_per_pos": v, "vllm_drafts": vd,
                         "eyas_accepted_per_depth": e, "eyas_rounds": ed, "max_relative_diff": off,
                         "verdict": verdict, "plain_outputs_differ": differ}
    if verdict == "far":
        causes = list(FAR_CAUSES)
        if differ:  # the targets already disagree without a draft: weights/dtype come first
            causes = causes[3:] + causes[:3]
        w["likely_causes"] = causes
    return w


def wiring_line(w: dict[str, Any]) -> str:
    s = (f"wiring: vLLM {SPEC_METHOD} k={w['k']} accepted per position {'/'.join(map(str, w['vllm_accepted_per_pos']))}"
         f" of {w['vllm_drafts']} drafts vs eyas chain steps {w['k']} (fp32) "
         f"{'/'.join(map(str, w['eyas_accepted_per_depth']))} of {w['eyas_rounds']} rounds, {w['prompts']} prompts: "
         f"{w['verdict']}")
    if w["verdict"] == "close":
        s += f" (largest difference {w['max_relative_diff']:.1%})"
    if w["verdict"] == "far":
        s += f" (largest difference {w['max_relative_diff']:.0%}); likely causes: " + "; ".join(w["likely_causes"])
    if w["plain_outputs_differ"]:
        s += (f"; vLLM plain greedy already differs from eyas fp32 plain on {len(w['plain_outputs_differ'])} "
              "prompts, so the counts cannot be equal there")
    return s


# ---- the phase bench runs ------------------------------------------------------------------------

def run_vllm_phase(cfg, py: Path, target: Target, draft: DraftCheckpoint | None, end_ids: list[int],
                   prompts: list[BenchPrompt], ids: list[list[int]], todo: list[int], out: Path,
                   say: Callable[[str], None]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The vllm methods on the prompts at `todo` (indices; the rest came from an earlier --resume run):
    their outputs (vllm_outputs; bench makes the rows) and what results.json records about the vLLM side."""
    if target.path is None:
        raise VllmBenchError(f"the vllm methods load the target's Hugging Face folder, and {target.source!r} has "
                             "none; pass a HF model folder or a .gguf (converted once into the eyas cache)")
    if cfg.dtype not in DTYPES:
        raise VllmBenchError(f"--dtype {cfg.dtype!r}: the vllm methods take {', '.join(DTYPES)}")
    k = vllm_k(cfg)
    info: dict[str, Any] = {"python": str(py), "version": vllm_version(py), "k": k, "method": SPEC_METHOD,
                            "dtype": DTYPES[cfg.dtype], "enforce_eager": True, "prefix_caching": False,
                            "target_folder": str(target.path), "draft_export": None, "runs": {}}
    draft_dir = None
    if "vllm-eagle3" in cfg.methods:
        if draft is None:
            raise VllmBenchError("vllm-eagle3 needs a draft; pass --draft DIR (or drop vllm-eagle3)")
        draft_dir = export_for_vllm(draft, target, k, cfg.dtype, out / "vllm" / "draft")
        info["draft_export"] = str(draft_dir)
    outs: list[dict[str, Any]] = []
    sub_p, sub_ids = [prompts[i] for i in todo], [ids[i] for i in todo]
    for m in vllm_methods(cfg.methods):
        if not sub_p:
            break
        say(f"bench: {m}: vLLM {info['version']} loads the target" + (f" and the draft (k={k})" if m != "vllm" else "")
            + f", {len(sub_p)} prompts")
        res = run_vllm_method(py, m, target, draft_dir if m == "vllm-eagle3" else None, k, cfg.dtype, sub_ids,
                              cfg.max_new_tokens, end_ids, out, say)
        info["runs"][m] = {key: res.get(key) for key in ("vllm_version", "torch_version", "load_seconds",
                                                         "wall_seconds", "speculative_config", "spec_total")}
        outs += vllm_outputs(sub_p, m, res, end_ids)
    return outs, info


def finish_vllm(cfg, target: Target, draft: DraftCheckpoint | None, end_ids: list[int], prompts: list[BenchPrompt],
                ids: list[list[int]], runners: dict, rows: list[dict[str, Any]], info: dict[str, Any],
                say: Callable[[str], None]) -> dict[str, Any]:
    """After every row exists: the fp32 reference, the vllm rows' identical marks, vLLM's own losslessness
    (vllm-eagle3 vs vllm) and the wiring line's numbers, into info (results.json's "vllm")."""
    k = info["k"]
    ref = fp32_reference(cfg, target, draft, end_ids, prompts, ids, runners, rows, k,
                         "vllm-eagle3" in cfg.methods, say)
    mark_vllm(rows, ref)
    info["reference"] = ref["how"]
    by = {(r["prompt"], r["method"]): r["token_ids"] for r in rows}
    if set(VLLM_METHODS) <= set(cfg.methods):
        same = [by[(p.id, "vllm-eagle3")] == by[(p.id, "vllm")] for p in prompts
                if (p.id, "vllm") in by and (p.id, "vllm-eagle3") in by]
        info["eagle3_vs_vllm_plain"] = {"identical": sum(same), "compared": len(same)}
    info["identical_to_eyas_fp32_plain"] = {
        m: {"identical": sum(bool(r.get("same_as_ref")) for r in rows if r["method"] == m),
            "compared": sum(r.get("same_as_ref") is not None for r in rows if r["method"] == m),
            "mismatches": [{"prompt": r["prompt"], "first_diff": r["first_diff"]} for r in rows
                           if r["method"] == m and r.get("same_as_ref") is False]}
        for m in vllm_methods(cfg.methods)}
    spec = [r for r in rows if r["method"] == "vllm-eagle3" and r.get("vllm")]
    if spec:
        info["spec_decode"] = {key: sum(r["vllm"][key] for r in spec) for key in ("drafts", "draft_tokens", "accepted")}
        info["spec_decode"]["accepted_per_pos"] = [sum(r["vllm"]["accepted_per_pos"][i] for r in spec)
                                                   for i in range(k)]
    info["wiring"] = wiring(rows, ref, k)
    return info


def render_vllm(info: dict[str, Any], con) -> None:
    """The vLLM lines under bench's table: identity checks, vLLM's own spec-decode counters, the wiring line."""
    for m, c in info.get("identical_to_eyas_fp32_plain", {}).items():
        if c["compared"]:
            differ = "".join(f"; differs on {d['prompt']} at token {d['first_diff']}" for d in c.get("mismatches", []))
            con.print(f"{m}: {c['identical']}/{c['compared']} prompts token-identical to eyas plain --weights fp32 "
                      f"(the weights vLLM {info['version']} runs, {info['dtype']}){differ}", markup=False,
                      highlight=False)
    e = info.get("eagle3_vs_vllm_plain")
    if e:
        con.print(f"vllm-eagle3: lossless within vLLM: {'yes' if e['identical'] == e['compared'] else 'NO'} "
                  f"({e['identical']}/{e['compared']} prompts token-identical to vllm)", markup=False, highlight=False)
    s = info.get("spec_decode")
    if s:
        con.print(f"vllm-eagle3: vLLM spec-decode metrics: {s['drafts']} drafts, {s['draft_tokens']} draft tokens, "
                  f"{s['accepted']} accepted, per position {'/'.join(map(str, s['accepted_per_pos']))}",
                  markup=False, highlight=False)
    if info.get("wiring"):
        w = info["wiring"]
        style = {"equal": "green", "close": "yellow", "far": "red"}[w["verdict"]]
        con.print(wiring_line(w), markup=False, highlight=False, style=style)
