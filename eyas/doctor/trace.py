"""`eyas doctor trace`: one prompt through the real serving path, observed stage by stage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..draft import DraftCheckpoint
from .checklist import jsonable

# ---- 7. trace: one prompt through the real serving path ---------------------------------------------
#
# The engine runs with its normal settings (tree or chain, KV caches, compaction); the trace only observes:
# the engine's target forward and the draft's finish/logits are wrapped on the instances and fc gets a
# forward hook, all removed afterwards. Nothing is disabled and no engine code changes.

@dataclass
class TraceEvent:
    round: int  # 0 = prefill, then one per speculative round
    stage: str  # target | capture k | concatenation | fc | draft layer | draft logits | accepted
    shape: list[int] | None = None
    norm: float | None = None  # mean L2 norm per row (last dim)
    note: str = ""


@dataclass
class TraceReport:
    prompt_tokens: int
    aux_indices: list[int]
    engine_ids: dict[str, Any]
    method: str
    events: list[TraceEvent]
    accepted: list[list[int]]  # per round, the tokens it committed (bonus included)
    text: str

    @property
    def tau(self) -> float:
        """Mean tokens committed per round after prefill (bonus included)."""
        r = self.accepted[1:]
        return sum(len(a) for a in r) / len(r) if r else 0.0

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return jsonable({"prompt_tokens": self.prompt_tokens, "aux_indices": self.aux_indices,
                         "engine_ids": self.engine_ids, "method": self.method, "tau": self.tau, "text": self.text,
                         "accepted": self.accepted, "events": [asdict(e) for e in self.events]})


def _row_norm(x: torch.Tensor) -> float:
    return float(x.detach().float().norm(dim=-1).mean())


def _decode(tok, ids: list[int]) -> str:
    if tok is None:
        return str(ids)
    return repr(tok.decode(ids))


@torch.no_grad()
def trace(target, ckpt: DraftCheckpoint, prompt_ids: list[int], spec=None, max_new_tokens: int = 32,
          max_rounds: int = 4, top: int = 5) -> TraceReport:
    """Run one prompt through eyas.engine.decode.Engine and record, per round, the shape and mean norm of every
    captured stream index, their concatenation, fc, the draft layer, the draft logits (top tokens) and
    the tokens accepted."""
    from ..conventions import engine_ids_table
    from ..engine.load import EngineParts, make_engine
    from ..engine.params import SamplingParams, TreeSettings

    eng = make_engine(EngineParts(target, ckpt, None), spec or TreeSettings().spec("tree", None))
    # Any: the trace patches methods on these instances (restored below), which their declared types forbid
    d: Any = eng.draft
    tm: Any = eng.model
    tok = target.tokenizer
    idx, H = list(ckpt.layout.aux_indices), target.hidden_size
    events: list[TraceEvent] = []
    rnd, depth = [0], [0]

    def ev(stage: str, x: torch.Tensor | None = None, note: str = "") -> None:
        events.append(TraceEvent(rnd[0], stage, list(x.shape) if x is not None else None,
                                 _row_norm(x) if x is not None else None, note))

    orig_forward = tm.forward

    def forward(ids, pos, cache, *a, **kw):
        start = cache.length
        out = orig_forward(ids, pos, cache, *a, **kw)
        what = "prefill" if start == 0 else ("verify tree" if kw.get("tree_mask") is not None else "verify")
        ev("target", None, f"{what}: {ids.shape[1]} tokens at positions {start}..{start + ids.shape[1] - 1}")
        cap = kw.get("capture")
        if cap and out.aux is not None:
            for j, k in enumerate(cap):
                ev(f"capture {k}", out.aux[..., j * H:(j + 1) * H],
                   "embedding" if k == 0 else f"output of layer {k - 1} (input of layer {k})")
            ev("concatenation", out.aux, f"cat{list(cap)}: the draft's fc input")
        return out

    def fc_hook(mod, args, out):
        depth[0] = 0
        ev("fc", out, f"fc {list(args[0].shape)} -> {list(out.shape)}; input norm {_row_norm(args[0]):.2f}")

    orig_finish, orig_logits = d.finish, d.logits

    def finish(attn_out, hidden):
        out = orig_finish(attn_out, hidden)
        ev("draft layer", out, "step 0 over the rows accepted last round" if depth[0] == 0 else
           f"the {out.shape[1]} frontier node(s) at depth {depth[0]}")
        return out

    def logits(out):
        lg = orig_logits(out)
        last = torch.softmax(lg[0, -1].float(), -1)
        p, i = last.topk(min(top, last.numel()))
        ids = d.draft_to_target(i).tolist()
        shown = ", ".join(f"{_decode(tok, [t])} {100 * float(q):.0f}%" for t, q in zip(ids, p, strict=True))
        ev("draft logits", lg, f"proposals for depth {depth[0] + 1}, top of the last row: {shown}")
        depth[0] += 1
        return lg

    handle = d.fc.register_forward_hook(fc_hook)
    tm.forward, d.finish, d.logits = forward, finish, logits
    accepted: list[list[int]] = []
    try:
        for new in eng.stream(list(prompt_ids), SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)):
            events.append(TraceEvent(rnd[0], "accepted", [len(new)], None, f"{len(new)} token(s): {_decode(tok, new)}"))
            accepted.append(list(new))
            rnd[0] += 1
            if rnd[0] > max_rounds:
                break
    finally:
        handle.remove()
        del tm.forward, d.finish, d.logits  # back to the class methods
    out_ids = [t for a in accepted for t in a]
    try:
        ids_table = engine_ids_table(idx, target.num_layers)
    except ValueError:
        ids_table = {}
    return TraceReport(len(prompt_ids), idx, ids_table, eng.spec.method, events, accepted,
                       tok.decode(out_ids) if tok is not None else str(out_ids))


def render_trace(rep: TraceReport, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    con.print(f"stream indices {rep.aux_indices}; engine ids: "
              + "; ".join(f"{k} {v}" for k, v in rep.engine_ids.items() if k in ("sglang", "vllm")))
    t = Table(title=f"eyas doctor trace ({rep.method}, {rep.prompt_tokens} prompt tokens, engine defaults)")
    t.add_column("round", justify="right")
    t.add_column("stage")
    t.add_column("shape")
    t.add_column("mean |x|", justify="right")
    t.add_column("note", overflow="fold")
    for e in rep.events:
        t.add_row(str(e.round), e.stage, str(e.shape) if e.shape else "", f"{e.norm:.2f}" if e.norm is not None else "",
                  e.note)
    con.print(t)
    con.print(f"tokens per round after prefill (bonus included): {rep.tau:.2f}; text: {rep.text!r}")
