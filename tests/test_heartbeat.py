"""Never 30 s without a sign of life: the heartbeat speaks after a silence, names the stage, and stays quiet while the
command writes or is idle on purpose."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from eyas import heartbeat


def run(body: str) -> str:
    code = ("import time, eyas.heartbeat as h\nh.QUIET_S = 0.6\nh.start('eyas demo', 'sleeping', poll_s=0.05)\n"
            + body)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "EYAS_HEARTBEAT": "1"})
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_a_silence_gets_one_line_naming_the_stage():
    err = run("time.sleep(1.0)\nh.stage('loading the target x')\ntime.sleep(1.0)\n")
    assert "eyas demo: still sleeping (" in err, err
    assert "eyas demo: still loading the target x (" in err, err


def test_output_and_idle_stages_keep_it_quiet():
    err = run("for _ in range(12):\n    print('working', flush=True)\n    time.sleep(0.1)\n"
              "h.stage(None)\ntime.sleep(1.2)\n")
    assert "still" not in err, err


def test_during_restores_the_stage_before_it_and_line_waits_for_the_silence():
    heartbeat.stage("outer")
    with heartbeat.during("inner"):
        assert heartbeat._state.what == "inner"
    assert heartbeat._state.what == "outer"
    heartbeat._state.last = time.monotonic()
    assert heartbeat.line() is None
    later = heartbeat.line(time.monotonic() + heartbeat.QUIET_S + 1)
    assert later is not None and later.startswith("eyas: still outer (")
    heartbeat.stage(None)
    assert heartbeat.line(time.monotonic() + 1000) is None


def test_on_for_a_terminal_off_for_a_pipe_unless_forced():
    assert heartbeat.wanted(None, tty=True) and not heartbeat.wanted(None, tty=False)
    assert heartbeat.wanted("1", tty=False) and not heartbeat.wanted("0", tty=True)
    code = "import time, eyas.heartbeat as h\nh.QUIET_S = 0.3\nh.start('eyas demo', poll_s=0.05)\ntime.sleep(0.8)\n"
    env = {k: v for k, v in os.environ.items() if k != "EYAS_HEARTBEAT"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and "still" not in r.stderr, r.stderr  # a pipe: a script reads this output
