"""The doctor tests' tiny target+draft pair (a draft that really learned its layout, see tests/test_doctor.py)
and the edits they make to copies of it. The `pair` fixture that builds it once per run is in
tests/conftest.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from eyas.data.shards import KIND, MANIFEST, Sample, is_heldout, write_shard
from eyas.draft import DraftConfig, Eagle3Draft, load_draft, save_draft
from eyas.engine.forward import TargetModel
from eyas.layout import Layout
from eyas.target.convert import tensor_fingerprint
from eyas.target.load import Target, identity_of
from eyas.train.ttt import ttt_forward
from eyas.vocab import vocab_hash
from tests.tiny import tiny_config

V, H, LAYERS, S, N_SEQ = 64, 32, 8, 32, 512
LAYOUT = [2, 4, 5]
HELDOUT_PCT = 20.0
DRAFT_VOCAB = 48


def tiny_target(seed: int = 0) -> Target:
    cfg, cls = tiny_config("llama", vocab=V, hidden=H, layers=LAYERS)
    cfg.initializer_range = 0.1
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = cls(cfg).eval()
    m.config.architectures = [cls.__name__]
    with torch.no_grad():
        for layer in m.model.layers:  # bigger residual writes: each stream index is its own thing
            layer.self_attn.o_proj.weight.mul_(3.0)
            layer.mlp.down_proj.weight.mul_(3.0)
    m.requires_grad_(False)
    return Target(model=m, tokenizer=None, identity=identity_of(m, tensor_fingerprint(m), "tiny"), source="tiny",
                  path=None)


@torch.no_grad()
def sample_text(target: Target, n: int, length: int, seed: int) -> torch.Tensor:
    """The target's own text: n sequences sampled at temperature 0.7 through eyas's engine forward."""
    tm = TargetModel(target.model)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (n, 1), generator=g)
    cache = tm.new_cache(n, length)
    out = tm.forward(ids, torch.zeros(n, 1, dtype=torch.long), cache, logits="last")
    cache.length = 1
    for t in range(1, length):
        nxt = torch.multinomial(torch.softmax(out.logits[:, -1] / 0.7, -1), 1, generator=g)
        ids = torch.cat([ids, nxt], 1)
        out = tm.forward(nxt, torch.full((n, 1), t), cache, logits="last")
        cache.length = t + 1
    return ids


class Pair:
    """The clean tiny pair: target, draft folder, held-out samples (token ids) and a shard folder of them."""

    def __init__(self, root: Path):
        torch.manual_seed(0)
        self.target = tiny_target()
        tm = TargetModel(self.target.model)
        ids = sample_text(self.target, N_SEQ, S, seed=1)  # [N, S]
        cap = tm.capture(ids, LAYOUT, logits="all")
        self.rows = list(range(N_SEQ))
        heldout = [r for r in self.rows if is_heldout(r, HELDOUT_PCT)]
        train = [r for r in self.rows if not is_heldout(r, HELDOUT_PCT)]
        self.ids, self.heldout = ids, heldout
        # draft vocabulary: the most frequent target argmax tokens of the training rows
        top = cap.logits.argmax(-1)[train].flatten()
        vocab = torch.sort(torch.bincount(top, minlength=V).argsort(descending=True)[:DRAFT_VOCAB]).values
        aux_tr = cap.aux[train]
        norms = {str(k): float(aux_tr[..., i * H:(i + 1) * H].norm(dim=-1).mean()) for i, k in enumerate(LAYOUT)}
        norms["final"] = float(cap.final_prenorm[train].norm(dim=-1).mean())
        self.layout = Layout(aux_indices=LAYOUT, target=self.target.identity, norms=norms)

        dc = DraftConfig.from_target_config(self.target.model.config, draft_vocab_size=DRAFT_VOCAB)
        torch.manual_seed(0)
        d = Eagle3Draft(dc)
        d.set_embeddings(self.target.embed_tokens().weight)
        d.set_vocab_map(vocab)
        opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=5e-3)
        g = torch.Generator().manual_seed(2)
        mask = torch.ones(N_SEQ, S, dtype=torch.bool)
        tr = torch.tensor(train)
        norm, head = self.target.final_norm(), self.target.lm_head()
        for _ in range(300):
            b = tr[torch.randint(0, len(tr), (32,), generator=g)]
            o = ttt_forward(d, cap.aux[b], cap.final_prenorm[b], ids[b], mask[b], norm, head, 2)
            opt.zero_grad()
            o.loss.backward()
            opt.step()
        d.eval()
        hb = torch.tensor(heldout)
        with torch.no_grad():
            o = ttt_forward(d, cap.aux[hb], cap.final_prenorm[hb], ids[hb], mask[hb], norm, head, 2)
        self.heldout_acc = (o.step_correct / o.step_count).tolist()
        extra = {"training": {"heldout_pct": HELDOUT_PCT, "ttt_steps": 2},
                 "metrics": {"heldout_acc": self.heldout_acc, "heldout_rows": o.step_count.tolist()},
                 "draft_vocab": {"size": DRAFT_VOCAB, "hash": vocab_hash(vocab)}}
        self.draft_dir = save_draft(root / "draft", d, self.layout, extra=extra)
        # a shard folder holding the held-out rows (bf16, like datagen's default)
        self.shards = root / "shards"
        self.shards.mkdir()
        samples = [Sample(r, ids[r], mask[r], cap.aux[r], cap.final_prenorm[r]) for r in self.rows]
        entry = write_shard(self.shards / "shard-00000.safetensors", samples)
        man = {"kind": KIND, "format_version": 1, "layout": self.layout.to_dict(), "shards": [entry],
               "counts": {"samples": len(samples)}}
        (self.shards / MANIFEST).write_text(json.dumps(man))

    def samples(self):
        return [self.ids[r] for r in self.heldout]

    def copy(self, dst: Path) -> Path:
        shutil.copytree(self.draft_dir, dst)
        return dst


def edit_json(path: Path, fn) -> None:
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d, indent=2))


def relabel(pair: Pair, dst: Path, indices: list[int]) -> Path:
    """A copy of the clean draft whose recorded layout (manifest + config.json ids) claims `indices`."""
    return relabel_dir(pair.draft_dir, dst, indices)


def relabel_dir(src: Path, dst: Path, indices: list[int]) -> Path:
    shutil.copytree(src, dst)
    old = load_draft(dst).layout
    lay = Layout(aux_indices=indices, target=old.target, norms=old.norms)
    edit_json(dst / "eyas_manifest.json", lambda m: m.update(layout=lay.to_dict()))
    cfg = load_draft(dst).model.config.hf_config(lay)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def statuses(report) -> dict[str, str]:
    return {c.name: c.status for c in report.checks}
