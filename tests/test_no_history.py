"""Tracked files speak of versions, dates and CPUs, not of how the work was organised.

Every line of a tracked text file that mentions a session, an issue number, "this box" or a session tag such as
`s15` fails this test, unless what it names is one of the legitimate senses listed in ALLOWED (each with why).
A legitimate use is removed from the line before the check, so a line holding both still fails.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = [
    re.compile(r"session", re.I),  # any sense not allowed below: "session 10", "this session's", "sessions 12-15"
    re.compile(r"\bissues? #?\d", re.I),  # "issue 15"
    re.compile(r"\bthis box\b", re.I),
    re.compile(r"\bs1\d\b|runs/s\d+\b"),  # session tags: "s15", "runs/s10/bench-final"
]

# (pattern, why it is legitimate). Matched text is blanked before FORBIDDEN is applied.
ALLOWED = [
    (re.compile(r"\(session,|\bsession\.(?=\w)|\bsession = |\bsession: [A-Z]|\breturn session\b|\bself\.session\b"),
     "a local variable or parameter holding a VllmSession (before the identifiers below blank its type)"),
    (re.compile(r"\b\w+_session\b|\b\w+Session\b"),
     "identifiers: VllmSession / LazySession (the vLLM worker process eyas drives), cfg.vllm_session, "
     "subprocess's start_new_session, requests.Session"),
    (re.compile(r"\bvllm[./]session\b"), "the module eyas/vllm/session.py"),
    (re.compile(r"""scope=["']session["']|session-scoped fixture"""), "pytest's session fixture scope"),
    (re.compile(r"\bits own session\b", re.I), "a POSIX process session (start_new_session=True)"),
]

# Not text, or written by tools: nothing to read.
BINARY_SUFFIXES = {".safetensors", ".png", ".gguf", ".so", ".bin", ".pt", ".gz", ".zip", ".jpg", ".ico"}


# This file spells out the words it forbids.
SELF = Path(__file__).resolve()


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    paths = [ROOT / p for p in out.decode().split("\0") if p]
    return [p for p in paths if p.suffix not in BINARY_SUFFIXES and p.is_file() and p.resolve() != SELF]


def history_mentions(path: Path, root: Path = ROOT) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return []
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line
        for pattern, _why in ALLOWED:
            stripped = pattern.sub(" ", stripped)
        if any(p.search(stripped) for p in FORBIDDEN):
            found.append(f"{path.relative_to(root)}:{number}: {line.strip()[:160]}")
    return found


def test_the_check_catches_history_and_passes_legitimate_uses(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("x = 1  # measured in session 10\n"
                      "# as seen (session 12: 98%)\n"
                      "# this box is slow\n"
                      "# see issue 15\n"
                      "# runs/s15/post.sh\n"
                      "session = VllmSession(py)  # its own session\n"
                      "out = session.call(op)\n"
                      "return session\n"
                      "@pytest.fixture(scope=\"session\")\n"
                      "p = Popen(cmd, start_new_session=True)\n"
                      "def f(session: VllmSession, n: int):\n")
    found = history_mentions(sample, tmp_path)
    assert [f.split(":")[1] for f in found] == ["1", "2", "3", "4", "5"], found


def test_tracked_files_carry_no_internal_history():
    found = [hit for path in tracked_text_files() for hit in history_mentions(path)]
    assert not found, "internal history in tracked files (speak of versions, dates and CPUs):\n" + "\n".join(found)
