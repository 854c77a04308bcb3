"""Text in and out: integer lists typed on the command line, stop strings in decoded text, and time spans.

Stop strings follow one rule everywhere (the engine, the server's streams, `eyas generate`): generation
ends at the first token whose decoded text (special tokens skipped) contains a stop string, and the text
ends where the earliest stop string in that text begins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import EyasError


def parse_int_list(text: str | None, what: str, *, ranges: bool = False, minimum: int | None = None,
                   error: type[Exception] = EyasError) -> list[int] | None:
    """'2,15,27' -> [2, 15, 27] in the order given; with `ranges`, '1,2,4', '2-6' or '1-3,8' -> sorted unique
    ints. None for no text. Raises `error` naming the flag (`what`), what was typed and the expected form."""
    if text is None or not text.strip():
        if minimum is None:
            return None
        text = text or ""
    example = "1,2,4 or ranges like 2-6" if ranges else "2,15,27"
    out: list[int] = []
    try:
        for part in text.replace(" ", "").split(","):
            if ranges and "-" in part.lstrip("-"):
                a, b = part.split("-")
                out.extend(range(int(a), int(b) + 1))
            elif part:
                out.append(int(part))
    except ValueError as e:
        raise error(f"{what} {text!r}: expected comma-separated integers such as {example}") from e
    if ranges:
        out = sorted(set(out))
    if minimum is not None and (not out or min(out) < minimum):
        raise error(f"{what} {text!r}: expected integers >= {minimum}, found {out}")
    return out


def find_stop(text: str, stop: list[str], start: int = 0) -> int | None:
    """Where the earliest stop string in `text` (at or after `start`) begins; None if none occurs."""
    hits = [i for i in (text.find(s, start) for s in stop if s) if i >= 0]
    return min(hits) if hits else None


def stop_cut(decode: Callable[[list[int]], str], ids: list[int], stop: list[str], first: int = 1,
             start: int = 0) -> tuple[int, str] | None:
    """The smallest token count n >= `first` whose text decode(ids[:n]) holds a stop string (searched from
    character `start`) -> (n, the text before that stop string); None if no prefix of `ids` holds one."""
    for n in range(first, len(ids) + 1):
        text = decode(ids[:n])
        hit = find_stop(text, stop, start)
        if hit is not None:
            return n, text[:hit]
    return None


def stop_prefix_len(tail: str, stop: list[str]) -> int:
    """Length of the longest suffix of `tail` that is a proper prefix of a stop string (text to hold back:
    a stop string may be forming)."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(tail)), best, -1):
            if tail.endswith(s[:k]):
                best = k
                break
    return best


class TextStream:
    """Turns one generation's token ids, pushed round by round, into text deltas.

    Each push decodes all ids so far: byte-level decoding is prefix-stable except that an incomplete
    UTF-8 sequence at the end decodes to U+FFFD, so trailing U+FFFD is held back until its remaining
    bytes arrive (or the generation ends). Text that might be the start of a stop sequence is held back
    too, so a stop sequence split across rounds is never sent. A full decode costs ~0.5 ms per 1k tokens
    here, far below a target forward, and keeps the streamed text equal to the non-streamed text.
    On a stop sequence, the text ends before it and the token count ends at the token that completed it.
    """

    def __init__(self, tokenizer: Any, stop: list[str], max_tokens: int):
        self.tok = tokenizer
        self.stop = [s for s in stop if s]
        self.max_tokens = max_tokens
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already handed out
        self.finish_reason: str | None = None  # set when the stream itself ends the generation

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def push(self, new_ids: list[int]) -> str:
        if self.finish_reason is not None:
            return ""
        room = self.max_tokens - len(self.ids)
        if len(new_ids) >= room:
            new_ids = new_ids[:room]
            self.finish_reason = "length"
        before = len(self.ids)
        self.ids += list(new_ids)
        text = self._decode(self.ids)
        # a stop string wholly inside the text already sent would have ended the stream earlier
        start = max(0, self.sent - max((len(s) for s in self.stop), default=1) + 1)
        if self.stop and find_stop(text, self.stop, start) is not None:
            cut = stop_cut(self._decode, self.ids, self.stop, before + 1, start)
            assert cut is not None  # the whole text holds a stop string, so some prefix does
            n, kept = cut
            self.ids = self.ids[:n]
            self.finish_reason = "stop"
            delta, self.sent = kept[self.sent:], max(self.sent, len(kept))
            return delta
        if self.finish_reason is not None:
            return self.finish()
        end = len(text)
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        end -= stop_prefix_len(text[self.sent:end], self.stop)
        delta, self.sent = text[self.sent:end], max(self.sent, end)
        return delta

    def finish(self) -> str:
        """The generation ended without a stop sequence: flush whatever was held back."""
        text = self._decode(self.ids)
        delta, self.sent = text[self.sent:], max(self.sent, len(text))
        return delta


def duration(seconds: float) -> str:
    """A time span as a person reads it: '45 s', '12 min', '3.4 h'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
