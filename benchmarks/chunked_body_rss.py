"""How much memory a server without an API key spends on a huge chunked request body.

    python benchmarks/chunked_body_rss.py [--gib 1.0] [--requests 3] [--port 0]

Starts `eyas serve --draft none` on a free localhost port (no --api-key, the default), waits for /health, then
--requests times POSTs a body of --gib GiB to /v1/completions with `Transfer-Encoding: chunked` (no
Content-Length to refuse it by), stopping as soon as the server answers, as a client would. It reads the
server's resident memory from /proc/<pid>/status (VmRSS now, VmHWM the peak) before the first request and after
each one, and prints the status, the bytes sent before the answer, and the rise in RSS and in peak RSS. The goal:
neither rises by more than ~50 MB (the server stops reading at its 16 MiB body limit). Linux only.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mem_kib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"error: eyas serve exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    sys.exit(f"error: eyas serve was not ready after {timeout_s:.0f} s")


def send_chunked(port: int, total: int, chunk: int = 1 << 20) -> tuple[int, str]:
    """POST `total` bytes chunked, stopping when the server answers -> (bytes sent, the answer's status line)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    piece = f"{chunk:x}\r\n".encode() + b"a" * chunk + b"\r\n"
    sent = 0
    try:
        while sent < total and not select.select([sock], [], [], 0)[0]:
            sock.sendall(piece)
            sent += chunk
        if sent >= total:
            sock.sendall(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server stopped reading and closed; its answer is already on the wire
    sock.settimeout(60)
    try:
        head = sock.recv(4096).split(b"\r\n", 1)[0].decode("latin-1")
    except OSError as e:
        head = f"no answer ({e})"
    finally:
        sock.close()
    return sent, head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    port = a.port or free_port()
    eyas = Path(sys.executable).with_name("eyas")
    proc = subprocess.Popen([str(eyas), "serve", "--draft", "none", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(port, proc)
        base = mem_kib(proc.pid)
        rows = []
        for i in range(a.requests):
            t = time.perf_counter()
            sent, status = send_chunked(port, int(a.gib * (1 << 30)))
            m = mem_kib(proc.pid)
            rows.append({"request": i + 1, "status": status, "sent_mib": round(sent / (1 << 20), 1),
                         "seconds": round(time.perf_counter() - t, 2),
                         "rss_rise_mb": round((m["VmRSS"] - base["VmRSS"]) / 1024, 1),
                         "peak_rise_mb": round((m["VmHWM"] - base["VmHWM"]) / 1024, 1)})
            print(json.dumps(rows[-1]))
        worst = max(max(r["rss_rise_mb"], r["peak_rise_mb"]) for r in rows)
        print(f"server RSS before {base['VmRSS'] / 1024:.0f} MB (peak {base['VmHWM'] / 1024:.0f} MB); largest rise "
              f"in RSS or peak RSS over {a.requests} bodies of {a.gib} GiB: {worst:.1f} MB (goal <= ~50 MB)")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
