"""Replay rows: a target's greedy replies to a prompt set and its stream states along them, captured once.

Greedy speculative decoding accepts a drafted token exactly when it is the target's greedy next token, and
lossless decoding commits the target's greedy reply whatever was drafted. So on a prompt whose recorded reply is
the target's own greedy output, every token and every stream state a verify computes along the accepted path is
already in the recording: a round can be replayed with the draft alone (eyas.replay.run).

A row holds:
  tokens: the prompt, then the target's greedy continuation of max_new_tokens + lookahead tokens with its end
    tokens NOT honoured. The committed reply ends at the first end token or after max_new_tokens; the tokens past
    it are what a verify compares drafted tokens with in a reply's last round (a draft may propose past the end,
    and the engines count what it gets right there);
  states [T, n_streams, H]: the stream states (eyas stream indices, `streams`, ascending) at the positions a
    draft reads: 0 .. prompt + reply - 2. The streams are the draft's layout plus its neighbours and the
    embedding output (stream 0), so a planted wiring fault (ids shifted by one, the embedding mixed in) replays
    from the same rows.

On disk: a folder with rows.safetensors (tokens, offsets, prompt_lens, state_offsets, states) and manifest.json
(kind eyas-replay-rows: the target's identity, streams, lengths, end tokens, who captured them in which numerics,
the prompt set, the file's digest); written atomically.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import EyasError
from ..files import atomic_folder, check_file, file_record, save_safetensors
from ..layout import TargetIdentity
from ..metadata import REPLAY_MANIFEST, read_metadata
from ..vocab import check_token_ids

KIND = "eyas-replay-rows"
FORMAT_VERSION = 1
FILE = "rows.safetensors"
MANIFEST = "manifest.json"
LOOKAHEAD = 16  # continuation tokens past the reply's end: covers any tree or chain up to depth 15


class ReplayError(EyasError):
    """Rows that cannot answer a replay (another target, a stream not captured, a reply too short); the message
    says what was expected, what was found and the fix."""


@dataclass
class ReplayRows:
    tokens: list[list[int]]  # per row: prompt + greedy continuation (end tokens not honoured)
    prompt_lens: list[int]
    states: list[torch.Tensor]  # per row [T_r, len(streams), H], positions 0..T_r-1
    streams: list[int]  # eyas stream indices of states' second axis, ascending
    max_new_tokens: int  # the reply length the rows were captured for (a replay may ask for fewer)
    eos: list[int]  # the target's end-of-turn tokens: where a committed reply ends
    identity: TargetIdentity
    numerics: str  # who computed tokens and states: eyas-fp32 | vllm-float32 | vllm-bfloat16 | shards
    source: dict[str, Any] = field(default_factory=dict)  # the prompt set, the command
    path: Path | None = None
    caps: list[int] | None = None  # per row, a lower max_new_tokens (rows cut from samples: eyas.replay.heldout)

    def __len__(self) -> int:
        return len(self.tokens)

    def head(self, n: int) -> None:
        """Keep the first n rows only."""
        self.tokens, self.prompt_lens, self.states = self.tokens[:n], self.prompt_lens[:n], self.states[:n]
        if self.caps is not None:
            self.caps = self.caps[:n]

    def prompt(self, i: int) -> list[int]:
        return self.tokens[i][:self.prompt_lens[i]]

    def reply(self, i: int, max_new_tokens: int | None = None) -> list[int]:
        """The committed greedy reply of row i: up to and including the first end token, at most max_new_tokens."""
        m = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if self.caps is not None:
            m = min(m, self.caps[i])
        cont = self.tokens[i][self.prompt_lens[i]:][:m]
        stop = set(self.eos)
        end = next((j for j, t in enumerate(cont) if t in stop), None)
        return cont if end is None else cont[:end + 1]

    def check_streams(self, wanted: list[int], what: str) -> None:
        missing = sorted(set(wanted) - set(self.streams))
        if missing:
            raise ReplayError(f"{what} needs stream indices {missing}, but the rows{_at(self.path)} hold only "
                              f"{self.streams}; capture rows for this draft (`eyas replay capture --draft D`)")

    def check_target(self, identity: TargetIdentity, what: str = "the target") -> None:
        a, b = self.identity, identity
        diff = [f"{k} {getattr(a, k)!r} vs {getattr(b, k)!r}" for k in ("architecture", "num_layers", "hidden_size",
                                                                         "vocab_size", "fingerprint")
                if getattr(a, k) != getattr(b, k)]
        if diff:
            raise ReplayError(f"the rows{_at(self.path)} were captured from another model than {what} ("
                              + "; ".join(diff) + "): capture rows from this target")


def _at(path: Path | None) -> str:
    return f" ({path})" if path is not None else ""


def plant_streams(aux: list[int], num_layers: int) -> list[int]:
    """The layout's streams, each one's neighbours and the embedding output (stream 0): what the replay of a
    planted wiring fault reads."""
    want = {0} | {k + d for k in aux for d in (-1, 0, 1)}
    return sorted(k for k in want if 0 <= k <= num_layers)


# ---- on disk ------------------------------------------------------------------------------------------

def save_rows(rows: ReplayRows, out: str | Path) -> Path:
    lens = [len(t) for t in rows.tokens]
    slen = [int(s.shape[0]) for s in rows.states]
    tensors = {
        "tokens": torch.tensor([t for r in rows.tokens for t in r], dtype=torch.long),
        "offsets": torch.tensor([0] + lens, dtype=torch.long).cumsum(0),
        "prompt_lens": torch.tensor(rows.prompt_lens, dtype=torch.long),
        "state_offsets": torch.tensor([0] + slen, dtype=torch.long).cumsum(0),
        "states": torch.cat([s.float().cpu() for s in rows.states]).contiguous(),
    }
    man = {"kind": KIND, "format_version": FORMAT_VERSION, "rows": len(rows), "streams": rows.streams,
           "max_new_tokens": rows.max_new_tokens, "eos": rows.eos, "target": rows.identity.to_dict(),
           "numerics": rows.numerics, "source": rows.source}

    def write(tmp: Path) -> None:
        save_safetensors(tensors, tmp / FILE, metadata={"producer": "eyas", "kind": KIND})
        man["files"] = {FILE: file_record(tmp / FILE)}
        (tmp / MANIFEST).write_text(json.dumps(man, indent=2))

    return atomic_folder(out, write)


def load_rows(path: str | Path) -> ReplayRows:
    from safetensors.torch import load_file

    p = Path(path)
    if not (p / MANIFEST).is_file():
        raise ReplayError(f"{p} is not a replay-rows folder (no {MANIFEST}); make one with `eyas replay capture "
                          "--out DIR`")
    fix = "the rows folder is damaged: capture it again with `eyas replay capture`"
    m = read_metadata(p / MANIFEST, REPLAY_MANIFEST, ReplayError, fix, kind=KIND)  # every field typed, bounded
    files, streams, max_new, eos = m["files"], m["streams"], m["max_new_tokens"], m["eos"]
    ident = TargetIdentity.from_dict(m["target"])
    check_file(p / FILE, files.get(FILE), ReplayError, fix)
    try:
        t = load_file(str(p / FILE))
        off, soff = t["offsets"].tolist(), t["state_offsets"].tolist()
        flat, plens, st = t["tokens"].tolist(), t["prompt_lens"].tolist(), t["states"]
        tokens = [flat[a:b] for a, b in zip(off, off[1:], strict=False)]
        states = [st[a:b] for a, b in zip(soff, soff[1:], strict=False)]
    except Exception as e:  # noqa: BLE001 - a corrupt header, a missing tensor: one line
        raise ReplayError(f"{p / FILE} is not readable replay rows ({type(e).__name__}: {e}); {fix}") from e
    # ids past the recorded target's vocabulary: the rows' identity is not the one their tokens came from
    check_token_ids(t["tokens"], off, ident.vocab_size, p / FILE, None, "capture the rows again from the target "
                    "with `eyas replay capture`")
    if not (len(tokens) == len(plens) == len(states)) or any(s.shape[1:] != (len(streams), ident.hidden_size)
                                                            for s in states):
        raise ReplayError(f"{p / FILE}: {len(tokens)} rows, {len(plens)} prompt lengths, {len(states)} state "
                          f"blocks, shapes {[tuple(s.shape) for s in states[:2]]}; expected one of each per row, "
                          f"[T, {len(streams)}, {ident.hidden_size}]; {fix}")
    return ReplayRows(tokens=tokens, prompt_lens=plens, states=states, streams=streams, max_new_tokens=max_new,
                      eos=eos, identity=ident, numerics=str(m.get("numerics", "")), source=m.get("source") or {},
                      path=p)


# ---- capture -----------------------------------------------------------------------------------------

def state_positions(rows_tokens: list[int], prompt_len: int, max_new: int, eos: list[int]) -> int:
    """How many positions' states a row needs: 0 .. prompt + committed reply - 2 (the last round's root is the
    reply's last token; the draft reads the states before it)."""
    cont = rows_tokens[prompt_len:][:max_new]
    stop = set(eos)
    end = next((j for j, t in enumerate(cont) if t in stop), None)
    reply = len(cont) if end is None else end + 1
    return prompt_len + reply - 1


@torch.no_grad()
def capture_rows_eyas(target, prompts: list[list[int]], max_new_tokens: int, streams: list[int],
                      lookahead: int = LOOKAHEAD, source: dict[str, Any] | None = None,
                      log: Callable[[str], None] | None = None) -> ReplayRows:
    """Rows from eyas's own engine in fp32 on the HF weights (the numerics vLLM's CPU build serves in): plain
    greedy decoding with end tokens not honoured, then one forward over prompt + continuation for the states."""
    from ..engine.load import EngineParts, make_engine
    from ..engine.params import SamplingParams, TreeSettings

    say = log or (lambda _m: None)
    eng = make_engine(EngineParts(target, None, None), TreeSettings().spec("plain", None, weights="fp32"))
    eos = sorted(eng.eos)
    eng.eos = set()  # the continuation past an end token: what a verify compares a draft's tokens with there
    tm, H = eng.model, target.hidden_size
    toks, states = [], []
    for i, ids in enumerate(prompts):
        say(f"row {i + 1}/{len(prompts)}: {len(ids)} prompt tokens + {max_new_tokens + lookahead} greedy")
        res = eng.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens + lookahead))
        seq = list(ids) + list(res.token_ids)
        n = state_positions(seq, len(ids), max_new_tokens, eos)
        cache = tm.new_cache(1, n)
        fo = tm.forward(torch.tensor([seq[:n]], device=tm.device), torch.arange(n, device=tm.device)[None], cache,
                        capture=streams, logits="none")
        toks.append(seq)
        assert fo.aux is not None  # capture=streams, the draft's (never empty)
        states.append(fo.aux[0].reshape(n, len(streams), H).float().cpu())  # [n, n_streams, H]
    return ReplayRows(tokens=toks, prompt_lens=[len(p) for p in prompts], states=states, streams=list(streams),
                      max_new_tokens=max_new_tokens, eos=eos, identity=target.identity,
                      numerics=f"eyas-{str(tm.dtype).replace('torch.', '').replace('float32', 'fp32')}",
                      source=source or {})


def capture_rows_vllm(py: Path, target, prompts: list[list[int]], max_new_tokens: int, streams: list[int],
                      work: Path, dtype: str = "float32", lookahead: int = LOOKAHEAD,
                      engine_args: dict[str, Any] | None = None, source: dict[str, Any] | None = None,
                      log: Callable[[str], None] | None = None) -> ReplayRows:
    """Rows from vLLM (its python `py`): greedy generation on a plain engine with end tokens ignored, then the
    states of prompt + continuation through extract_hidden_states (eyas/vllm/capture_worker.py). `target` may be
    loaded without weights: eyas needs its tokenizer, config and identity only."""
    from safetensors.torch import load_file

    from ..target.load import end_token_ids
    from ..vllm.session import VllmSession, aux_ids

    say = log or (lambda _m: None)
    if target.path is None:
        raise ReplayError(f"--engine vllm needs the target as a HF folder; {target.source} has none")
    L, H = target.num_layers, target.hidden_size
    ids = aux_ids(streams, L)
    pick = [ids.index(k) for k in streams]
    eos = sorted(set(end_token_ids(target.tokenizer, target.model)))
    longest = max(len(p) for p in prompts) + max_new_tokens + lookahead
    req = {"model": str(target.path), "dtype": dtype, "max_model_len": longest + 16, "aux_ids": ids, "seed": 0,
           "generator": "auto", "engine_args": engine_args or {}}
    work.mkdir(parents=True, exist_ok=True)
    say(f"starting vLLM ({py}) on {target.path}: {len(prompts)} prompts, streams {streams}")
    with VllmSession(py, req, work, log=lambda _line: None) as worker:
        info = worker.info
        if (info["num_layers"], info["hidden_size"]) != (L, H):
            raise ReplayError(f"vLLM loaded a model of {info['num_layers']} layers x {info['hidden_size']}, eyas's "
                              f"target has {L} x {H}: pass the same model to both")
        out = worker.call({"op": "generate", "prompts": prompts, "max_tokens": [max_new_tokens + lookahead]
                            * len(prompts), "temperature": 0.0, "top_p": 1.0, "seeds": [0] * len(prompts),
                            "stop_ids": [], "ignore_eos": True})
        toks = [list(p) + [int(t) for t in r] for p, r in zip(prompts, out["replies"], strict=True)]
        cut = [state_positions(t, len(p), max_new_tokens, eos) for t, p in zip(toks, prompts, strict=True)]
        file = work / "replay-capture.safetensors"
        r = worker.call({"op": "capture", "rows": [t[:n] for t, n in zip(toks, cut, strict=True)],
                          "file": str(file)})
        t = load_file(r["file"])
        file.unlink()
    hs = t["hidden_states"]  # [sum(cut), len(ids), H], rows back to back
    if hs.shape[1:] != (len(ids), H) or t["lengths"].tolist() != cut:
        raise ReplayError(f"the vLLM worker returned states of shape {tuple(hs.shape)} for rows of lengths "
                          f"{t['lengths'].tolist()}; expected [tokens, {len(ids)}, {H}] for {cut}")
    states, a = [], 0
    for n in cut:
        states.append(hs[a:a + n][:, pick].float().contiguous())
        a += n
    return ReplayRows(tokens=toks, prompt_lens=[len(p) for p in prompts], states=states, streams=list(streams),
                      max_new_tokens=max_new_tokens, eos=eos, identity=target.identity, numerics=f"vllm-{dtype}",
                      source={**(source or {}), "vllm": info.get("vllm")})


def rows_summary(rows: ReplayRows) -> dict[str, Any]:
    replies = [len(rows.reply(i)) for i in range(len(rows))]
    return {"rows": len(rows), "prompt_tokens": sum(rows.prompt_lens), "reply_tokens": sum(replies),
            "streams": rows.streams, "max_new_tokens": rows.max_new_tokens, "numerics": rows.numerics,
            "target": asdict(rows.identity)}


def cached_rows_eyas(target, prompts: list[list[int]], max_new_tokens: int, streams: list[int],
                     source: dict[str, Any] | None = None, log: Callable[[str], None] | None = None) -> ReplayRows:
    """capture_rows_eyas once per (target, prompts, length, streams): kept under $EYAS_CACHE/replay, so a check
    repeated on the same prompts replays in seconds."""
    import hashlib

    from ..files import cache_dir
    from ..target.family import engine_covers, text_config

    family = getattr(text_config(target.config), "model_type", None)
    if not engine_covers(family):
        raise ReplayError(f"eyas's engine does not run the {family!r} family, so it cannot capture replay rows "
                          "itself: capture them where the target runs (`eyas replay capture --engine vllm --out "
                          "DIR`) and pass --rows DIR")
    key = json.dumps([target.identity.fingerprint, prompts, max_new_tokens, LOOKAHEAD, streams, FORMAT_VERSION])
    folder = cache_dir() / "replay" / hashlib.sha256(key.encode()).hexdigest()[:20]
    if (folder / MANIFEST).is_file():
        try:
            return load_rows(folder)
        except ReplayError:
            pass  # damaged: captured again below, replacing it atomically
    rows = capture_rows_eyas(target, prompts, max_new_tokens, streams, source=source, log=log)
    save_rows(rows, folder)
    return load_rows(folder)
