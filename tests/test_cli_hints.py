"""The root command's small courtesies: a version, and one-line hints for an option placed before its command and
for generate's prompt given without --prompt (click alone says "No such option" or "unexpected extra argument")."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from eyas import __version__
from eyas.cli import app, misplaced


def test_version():
    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"eyas {__version__}"


def test_an_option_before_its_command_is_moved_in_the_hint():
    assert misplaced(["--port", "8000", "serve"]) == ("error: --port is an option of `eyas serve`, and a command's "
                                                      "options go after it: eyas serve --port 8000")
    assert "eyas doctor --draft d" in misplaced(["--draft", "d", "doctor"])
    assert misplaced(["--help"]) is None and misplaced(["serve", "--port", "1"]) is None
    assert misplaced(["--nonsense"]) is None  # no command named: click's own error stands


def test_a_bare_prompt_to_generate_gets_the_option_it_needs():
    assert misplaced(["generate", "hello world", "--draft", "none"]) == (
        "error: `eyas generate` takes its text as an option: eyas generate --prompt 'hello world' --draft none")
    assert misplaced(["generate", "--prompt", "hi"]) is None


def test_the_console_entry_point_prints_the_hint_in_one_line():
    r = subprocess.run([sys.executable, "-m", "eyas", "--port", "8000", "serve"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --port is an option of `eyas serve`, and a command's options go after it: eyas serve --port 8000"]


def test_every_commands_help_is_flowing_text():
    """Typer keeps a docstring's line breaks, which broke `eyas --help` descriptions mid-sentence."""
    from eyas.cli import app

    def commands(t):
        yield from t.registered_commands
        for g in t.registered_groups:
            yield from commands(g.typer_instance)

    helps = {(c.name or c.callback.__name__): c.help for c in commands(app)}
    assert len(helps) > 15 and all(h and "\n" not in h for h in helps.values()), helps
    r = CliRunner().invoke(app, ["--help"])
    assert "tau, acceptance, draft" in " ".join(r.output.split()), r.output
