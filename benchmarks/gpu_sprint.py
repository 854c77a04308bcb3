"""The GPU sprint: on a bare, offline machine, put eyas's GPU kit back together, install it with --no-index, and run
eyas's CUDA path end to end within a fixed wall-clock budget, one PASS/FAIL/SKIP line per stage, every stage timed.
Standard library only (it runs before eyas is installed); eyas runs as `python -m eyas` from the installed wheel.

    python3 benchmarks/gpu_sprint.py check KIT            # a staging call: which call folders are there, intact
    python3 benchmarks/gpu_sprint.py run KIT --out DIR    # install, then every stage; results into DIR

Stages: install (kit -> WORK/site, eyas imported from there, asserted), env, generate, bench-check (plain, chain
and tree with the shipped draft), lossless, datagen (the target regenerates replies to the kit's ShareGPT prompts,
batched, for REGEN_S seconds, capturing each chunk's features as it goes), train (warm-started from the shipped
draft, bf16, --max-time TRAIN_S), doctor (the new draft on held-out rows of the new shards: stored features
against fresh captures through the serving path), tau-reference and tau-default (the new draft on the 8 MT-bench
questions at depth 6 / topk 10 / 60 tokens and at the device's default tree; plain vs tree tok/s and the lossless
check), and, time left, tau-reference-shipped. Into DIR (the run tool's $OUT): results.json, logs.tar.gz and the
new draft as draft.tar.partK (each file under 16 MiB); `benchmarks/gpu_kit.py collect` puts it back together.

Sizes and budgets are environment variables (see Settings: the field name in capitals), so the same script runs
tiny on the CPU: DEVICE=cpu BUDGET_S=300 REGEN_S=20 REGEN_NUM=4 ... (tests/test_gpu_kit.py does).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_parts import KitError, kit_items, mib, put_back, read_manifest, sha256_file, split_file, staged  # noqa: E402

PART_BYTES = 15 << 20  # each file back under $OUT stays below the 16 MiB the run tool returns
LOG_CAP = 512 << 10  # bytes of each stage's log kept (its end)
LOGS_CAP = 15 << 20
REFERENCE_TREE = ["--depth", "6", "--topk", "10", "--tokens", "60", "--lookup", "0", "--ngram", "none",
                  "--min-prob", "0"]
GRACE_S = 30  # after a stage's SIGINT, before SIGKILL
MIN_STAGE_S = 10  # a stage is not started with less time than this left
MARKER = ".eyas-sprint"
PROMPTS_START = 8400  # as benchmarks/gpu_kit.py


@dataclass
class Settings:
    """Every size and budget, read from the environment (DEVICE=cpu, BUDGET_S=300, ...)."""

    device: str = "cuda"
    budget_s: float = 540.0  # the whole sprint, install to packing; later stages shrink or are skipped to fit
    work: str = "/tmp/eyas-sprint"
    gen_tokens: int = 64
    check_limit: int = 2
    check_tokens: int = 64
    doctor_samples: int = 3
    regen_s: float = 150.0
    regen_num: int = 0  # 0: every prompt of the kit
    regen_tokens: int = 256
    gen_batch: int = 256
    max_len: int = 1024
    train_s: float = 75.0
    train_epochs: float = 4.0
    batch_tokens: int = 16384
    lr: float = 2e-4
    ttt_steps: int = 3
    bf16: int = -1  # -1: on for CUDA, off on the CPU
    tau_limit: int = 8
    tau_tokens: int = 128
    threads: int = 0  # > 0: OMP_NUM_THREADS for every stage (1 on a busy CPU: spinning threads wait on each other)
    shipped_tau: int = 1  # 0: no tau-reference-shipped (the shipped draft at the reference tree, for comparison)
    repeat_plain: int = 0  # 1: bench runs plain twice per prompt (its noise), at the cost of the time it takes
    # what the stages after datagen are expected to take: datagen stops early enough to leave it
    tau_estimate_s: float = 75.0
    train_overhead_s: float = 40.0
    pack_reserve_s: float = 15.0

    @classmethod
    def from_env(cls, env: dict[str, str]) -> Settings:
        s = cls()
        for f in fields(cls):
            if f.name.upper() in env:
                kind = type(getattr(s, f.name))
                try:
                    setattr(s, f.name, kind(env[f.name.upper()]))
                except ValueError as e:
                    raise KitError(f"{f.name.upper()}={env[f.name.upper()]!r}: expected a {kind.__name__}") from e
        if s.bf16 < 0:
            s.bf16 = int(s.device != "cpu")
        return s


@dataclass
class Stage:
    name: str
    status: str  # PASS | FAIL | SKIP
    seconds: float
    detail: str = ""


@dataclass
class Sprint:
    kit: Path | None  # None: eyas and its data packages are installed already (`make setup`), nothing to unpack
    out: Path
    s: Settings
    t0: float = field(default_factory=time.monotonic)
    stages: list[Stage] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def work(self) -> Path:
        return Path(self.s.work).resolve()  # the stages run inside it: every path they get is absolute

    def left(self) -> float:
        return self.s.budget_s - (time.monotonic() - self.t0)

    def record(self, name: str, ok: bool | None, t0: float, detail: str = "") -> bool:
        status = {True: "PASS", False: "FAIL", None: "SKIP"}[ok]
        stage = Stage(name, status, round(time.monotonic() - t0, 1), detail)
        self.stages.append(stage)
        print(f"{status} {name} ({stage.seconds:.0f} s){': ' + detail if detail else ''}", flush=True)
        return bool(ok)

    def log(self, name: str) -> Path:
        return self.work / "logs" / f"{name}.log"

    def call(self, name: str, args: list[str], timeout: float) -> int:
        """`python args...` with the installed kit's environment, output to logs/NAME.log. At `timeout` seconds it
        gets SIGINT (eyas stops at a safe point and saves), then SIGKILL after GRACE_S; returns the exit code."""
        self.log(name).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log(name), "ab") as log:
            proc = subprocess.Popen([sys.executable, *args], cwd=self.work, env=self.env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                return proc.wait(timeout=max(timeout, 1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    return proc.wait(timeout=GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    return proc.wait()

    def eyas(self, name: str, args: list[str], cap: float) -> tuple[bool | None, float]:
        """One eyas command as a stage that must exit 0 within min(cap, what is left): (ok, its start time); ok is
        None when too little time is left to start it (the stage is skipped)."""
        t0 = time.monotonic()
        timeout = min(cap, self.left() - self.s.pack_reserve_s)
        if timeout < MIN_STAGE_S:
            self.log(name).write_text(f"not started: {self.left():.0f} s of BUDGET_S left\n")
            return None, t0
        rc = self.call(name, ["-m", "eyas", *args], timeout)
        return rc == 0, t0

    def line(self, name: str, key: str = "") -> str:
        """The last line of a stage's log holding `key` (the last line at all when none does)."""
        lines = [x for x in self.log(name).read_text(errors="replace").splitlines() if x.strip()]
        hits = [x for x in lines if key in x] if key else []
        return (hits or lines or ["(no output)"])[-1][-300:]


# ---- install ---------------------------------------------------------------------------------------------------

def check(kit: Path) -> int:
    """A staging call's command: what is staged so far, every part's size and digest checked."""
    m = read_manifest(kit)
    bad = 0
    for call, problems in staged(kit, m).items():
        sizes = sum(p.size for i in kit_items(m) for p in i.parts if p.path.startswith(call + "/"))
        if not problems:
            print(f"staged {call}: {mib(sizes)}, every part intact")
        elif all(p.endswith("is missing") for p in problems):
            print(f"not yet {call}: carry it in its call")
        else:
            bad += 1
            print(f"DAMAGED {call}: {problems[0]}; carry it again")
    return 1 if bad else 0


def stage_env(extra: dict[str, str], threads: int) -> dict[str, str]:
    # PYTHONSAFEPATH: no current folder on the path, so a source tree there cannot shadow the installed eyas
    return {**os.environ, **extra, "PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            **({"OMP_NUM_THREADS": str(threads)} if threads else {})}


def install(sp: Sprint) -> bool:
    """Put every item back under WORK/kit, pip-install the wheels into WORK/site with --no-index, and check that
    eyas is imported from there (not from a source tree on the path). Without a kit: the eyas this python has."""
    t0 = time.monotonic()
    if sp.kit is None:
        sp.env = stage_env({}, sp.s.threads)
        sp.record("install", None, t0, f"no kit: the eyas {sys.executable} has")
        return True
    try:
        m = read_manifest(sp.kit)
        missing = [f"{c} ({p[0]})" for c, p in staged(sp.kit, m).items() if p]
        if missing:
            raise KitError(f"call folders missing or damaged: {', '.join(missing)}; the machine was given back "
                           "between calls (staged folders are lost): make the calls again, back to back")
        unpacked = sp.work / "kit"
        for item in kit_items(m):
            put_back(item, sp.kit, unpacked / item.dest)
    except KitError as e:
        return sp.record("install", False, t0, str(e))
    site = sp.work / "site"
    wheels = sorted(str(p) for p in (unpacked / "wheels").glob("*.whl"))
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                          "--no-cache-dir", "--disable-pip-version-check", "--upgrade", "--target", str(site),
                          *wheels], capture_output=True, text=True)
    sp.log("install").parent.mkdir(parents=True, exist_ok=True)
    sp.log("install").write_text(pip.stdout + pip.stderr)
    if pip.returncode != 0:
        return sp.record("install", False, t0, f"pip: {sp.line('install')}")
    sp.env = stage_env({"PYTHONPATH": os.pathsep.join([str(site), str(unpacked / "pkgs")])}, sp.s.threads)
    sp.results["kit"] = {k: m[k] for k in ("created", "eyas", "python_version", "carried_dists", "prompts")}
    return sp.record("install", True, t0, f"{len(wheels)} wheels, {len(m['items'])} items, eyas {m['eyas']['source']}")


ENV_PROBE = """
import json, sys, torch, transformers, eyas
cuda = torch.cuda.is_available()
print(json.dumps({"python": sys.version.split()[0], "torch": torch.__version__,
                  "transformers": transformers.__version__, "eyas": eyas.__version__, "eyas_file": eyas.__file__,
                  "cuda": cuda, "gpu": torch.cuda.get_device_name(0) if cuda else None}))
"""


def environment(sp: Sprint) -> bool:
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-c", ENV_PROBE], cwd=sp.work, env=sp.env, capture_output=True, text=True,
                         timeout=120)
    sp.log("env").write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        return sp.record("env", False, t0, sp.line("env"))
    info = json.loads(run.stdout.strip().splitlines()[-1])
    sp.results["environment"] = info
    site = (sp.work / "site").resolve()
    if sp.kit is not None and not Path(info["eyas_file"]).resolve().is_relative_to(site):
        return sp.record("env", False, t0, f"eyas came from {info['eyas_file']}, not the kit's wheel in {site}")
    if sp.s.device.startswith("cuda") and not info["cuda"]:
        return sp.record("env", False, t0, f"torch {info['torch']} sees no CUDA device")
    return sp.record("env", True, t0, f"torch {info['torch']}, transformers {info['transformers']}, "
                     f"{info['gpu'] or 'cpu'}, eyas {info['eyas']} from {'the kit' if sp.kit else info['eyas_file']}")


# ---- the CUDA check ----------------------------------------------------------------------------------------------

def bench_summary(folder: Path, draft: str, tree: str) -> dict[str, Any]:
    res = json.loads((folder / "results.json").read_text())
    methods = {m: {k: v.get(k) for k in ("tau", "tok_s", "decode_tok_s", "identical", "compared", "new_tokens")}
               for m, v in res["summary"]["methods"].items()}
    lossless = all(v["identical"] == v["compared"] and v["compared"] for m, v in methods.items() if m != "plain")
    return {"draft": draft, "tree": tree, "specs": res.get("specs"), "methods": methods, "lossless": lossless,
            "environment": res.get("environment")}


def bench_stage(sp: Sprint, name: str, draft: str, methods: str, limit: int, tokens: int,
                tree: list[str] | None = None, cap: float = 240, need_lossless: bool = True) -> bool:
    """One `eyas bench` run as a stage: PASS when it ran and (need_lossless) every method matched plain."""
    folder = sp.work / name
    ok, t0 = sp.eyas(name, ["bench", "--bench", "mt-bench", "--limit", str(limit), "--max-new-tokens", str(tokens),
                            "--methods", methods, "--draft", draft, "--device", sp.s.device, "--out", str(folder),
                            "--quiet", "--repeat-plain" if sp.s.repeat_plain else "--no-repeat-plain", *(tree or [])],
                     cap)
    if ok is None:
        return sp.record(name, None, t0, sp.line(name))
    if not ok or not (folder / "results.json").is_file():
        return sp.record(name, False, t0, sp.line(name))
    b = bench_summary(folder, draft, "reference" if tree else "default")
    sp.results.setdefault("benches", {})[name] = b
    text = ", ".join(f"{m} tau {v['tau']:.2f} {v['tok_s']:.1f} tok/s" for m, v in b["methods"].items())
    text += f"; lossless {'yes' if b['lossless'] else 'NO'}"
    return sp.record(name, b["lossless"] or not need_lossless, t0, text)


def cuda_check(sp: Sprint) -> None:
    s = sp.s
    ok, t0 = sp.eyas("generate", ["generate", "--prompt", "Give three tips for learning a new language.",
                                  "--max-new-tokens", str(s.gen_tokens), "--device", s.device], 240)
    sp.record("generate", ok, t0, sp.line("generate", "tok/s"))
    t0 = time.monotonic()
    if bench_stage(sp, "bench-check", "default", "plain,chain,tree", s.check_limit, s.check_tokens,
                   need_lossless=False):
        b = sp.results["benches"]["bench-check"]
        bad = [f"{m} {v['identical']}/{v['compared']}" for m, v in b["methods"].items()
               if m != "plain" and v["identical"] != v["compared"]]
        sp.record("lossless", b["lossless"], t0, "chain and tree token-identical to plain" if b["lossless"] else
                  "differ from plain: " + ", ".join(bad))
    else:
        sp.record("lossless", None, t0, "no bench results")


# ---- data, training, tau ------------------------------------------------------------------------------------------

def datagen(sp: Sprint) -> bool:
    """Regenerate replies to the kit's prompts for at most REGEN_S seconds (less when the later stages need the
    time), capturing each chunk's features as it goes; SIGINT at the budget keeps every committed chunk."""
    s = sp.s
    after = s.train_s + s.train_overhead_s + 3 * s.tau_estimate_s + s.pack_reserve_s
    budget = max(min(s.regen_s, sp.left() - after), min(s.regen_s, 10.0))
    out = sp.work / "data"
    # the kit's prompts are ShareGPT rows from 8400 on (the shipped draft trained on rows before 8,327); without a
    # kit the bundled ShareGPT from that row
    data = ["--data", str(sp.work / "kit" / "data" / "prompts.jsonl")] if sp.kit else \
        ["--data", "sharegpt", "--start-row", str(PROMPTS_START)]
    args = ["datagen", *data, "--out", str(out),
            "--max-len", str(s.max_len), "--max-new-tokens", str(s.regen_tokens), "--max-turns", "1",
            "--gen-batch", str(s.gen_batch), "--shard-samples", str(s.gen_batch), "--device", s.device, "--quiet"]
    args += ["--num", str(s.regen_num)] if s.regen_num > 0 else []
    t0 = time.monotonic()
    rc = sp.call("datagen", ["-m", "eyas", *args], budget)
    try:
        c = json.loads((out / "manifest.json").read_text())["counts"]
    except (OSError, json.JSONDecodeError, KeyError):
        return sp.record("datagen", False, t0, sp.line("datagen"))
    regen_s = c.get("regen_ms", 0) / 1000
    sp.results["datagen"] = {"exit_code": rc, "budget_s": round(budget, 1), "counts": c,
                             "regen_s": regen_s, "capture_s": round(c.get("seconds", 0) - regen_s, 1)}
    ok = rc in (0, 130) and c.get("samples", 0) > 0
    return sp.record("datagen", ok, t0, f"{c.get('samples', 0)} samples, {c.get('tokens', 0)} tokens; "
                     f"{c.get('regenerated_replies', 0)} replies, {c.get('regenerated_tokens', 0)} new tokens in "
                     f"{regen_s:.0f} s of regeneration ({c.get('regenerated_tokens', 0) / max(regen_s, 1e-9):.0f} "
                     f"tok/s), capture {c.get('seconds', 0) - regen_s:.0f} s; budget {budget:.0f} s"
                     + ("" if rc == 0 else f", stopped at it (exit {rc})"))


def train(sp: Sprint) -> bool:
    s = sp.s
    out = sp.work / "train"
    budget = max(min(s.train_s, sp.left() - s.train_overhead_s - 3 * s.tau_estimate_s - s.pack_reserve_s),
                 min(s.train_s, 5.0))
    args = ["train", "--data", str(sp.work / "data"), "--out", str(out), "--init-from", "default", "--ttt-steps",
            str(s.ttt_steps), "--epochs", str(s.train_epochs), "--max-time", str(budget), "--lr", str(s.lr),
            "--batch-tokens", str(s.batch_tokens), "--max-len", str(s.max_len), "--eval-every", "1000000",
            "--save-every", "1000000", "--replay-samples", "8", "--device", s.device, "--quiet"]
    ok, t0 = sp.eyas("train", args + (["--bf16"] if s.bf16 else []), budget + s.train_overhead_s + 60)
    if ok is None:
        return sp.record("train", None, t0, sp.line("train"))
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()] \
        if (out / "metrics.jsonl").is_file() else []
    ok = ok and (out / "draft" / "model.safetensors").is_file() and bool(metrics)
    if not ok:
        return sp.record("train", False, t0, sp.line("train"))
    first, last = metrics[0], metrics[-1]
    sp.results["train"] = {"budget_s": round(budget, 1), "bf16": bool(s.bf16), "first": first, "last": last}
    acc = "/".join(f"{a:.3f}" for a in last.get("heldout_acc", []))
    before = "/".join(f"{a:.3f}" for a in first.get("heldout_acc", []))
    return sp.record("train", True, t0, f"{last['step']} steps, {last['tokens_seen']} tokens, "
                     f"{last.get('tokens_per_s', 0):.0f} tok/s; held-out acc {before} -> {acc}; budget {budget:.0f} s")


def doctor(sp: Sprint, have_draft: bool) -> None:
    """Every wiring check through the CUDA serving path, on held-out rows of the new shards: their stored features
    (captured by datagen) against fresh captures of the same tokens."""
    t0 = time.monotonic()
    if not (sp.work / "data" / "manifest.json").is_file():
        sp.record("doctor", None, t0, "no shards")
        return
    draft = str(sp.work / "train" / "draft") if have_draft else "default"
    ok, t0 = sp.eyas("doctor", ["doctor", "--target", "smollm2-135m", "--draft", draft, "--data",
                                str(sp.work / "data"), "--samples", str(sp.s.doctor_samples), "--device",
                                sp.s.device], 2 * sp.s.tau_estimate_s)
    sp.record("doctor", ok, t0, ("new draft: " if have_draft else "shipped draft: ") + sp.line("doctor"))


def tau(sp: Sprint, have_draft: bool) -> None:
    s = sp.s
    new = str(sp.work / "train" / "draft")
    runs = [("tau-reference", new, REFERENCE_TREE), ("tau-default", new, None),
            ("tau-reference-shipped", "default", REFERENCE_TREE)]
    for name, draft, tree in runs:
        t0 = time.monotonic()
        if draft == new and not have_draft:
            sp.record(name, None, t0, "no new draft")
        elif name.endswith("shipped") and not s.shipped_tau:
            sp.record(name, None, t0, "SHIPPED_TAU=0")
        elif name.endswith("shipped") and sp.left() < s.tau_estimate_s + s.pack_reserve_s:
            sp.record(name, None, t0, f"{sp.left():.0f} s left")
        else:
            bench_stage(sp, name, draft, "plain,tree", s.tau_limit, s.tau_tokens, tree, cap=4 * s.tau_estimate_s)


# ---- what goes back ----------------------------------------------------------------------------------------------

def pack(sp: Sprint) -> None:
    """results.json, logs.tar.gz (each log's end, the bench results, the training curves) and the draft's parts."""
    sp.out.mkdir(parents=True, exist_ok=True)
    draft = sp.work / "train" / "draft"
    if (draft / "model.safetensors").is_file():
        tar = sp.work / "draft.tar"
        with tarfile.open(tar, "w") as t:
            t.add(draft, arcname="draft")
        item = split_file(tar, sp.out, PART_BYTES)
        sp.results["draft"] = {"item": item.to_dict(), "model_sha256": sha256_file(draft / "model.safetensors"),
                               "files": sorted(p.name for p in draft.iterdir())}
    extra = [p for p in [*sp.work.glob("*/results.json"), *sp.work.glob("*/bench.png"), sp.work / "data" /
                         "manifest.json", *(sp.work / "train").glob("*.json*"), sp.work / "train" / "curves.png"]
             if p.is_file()]
    with tarfile.open(sp.out / "logs.tar.gz", "w:gz") as t:
        for p in [*sorted((sp.work / "logs").glob("*.log")), *extra]:
            data = p.read_bytes()
            if p.suffix == ".log":
                data = data[-LOG_CAP:]
            if t.fileobj.tell() + len(data) > LOGS_CAP:
                break
            info = tarfile.TarInfo(p.relative_to(sp.work).as_posix())
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    sp.results.update(kind="eyas-gpu-sprint", format_version=1, settings=asdict(sp.s),
                      stages=[asdict(x) for x in sp.stages], wall_s=round(time.monotonic() - sp.t0, 1))
    (sp.out / "results.json").write_text(json.dumps(sp.results, indent=1, default=str))


def fresh_work(work: Path) -> None:
    """WORK emptied for this run: only a folder an earlier sprint made (it holds MARKER) is ever removed."""
    if work.exists() and any(work.iterdir()):
        if not (work / MARKER).is_file():
            raise KitError(f"WORK={work} is not empty and no sprint made it; point WORK at a new folder")
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    (work / MARKER).write_text("benchmarks/gpu_sprint.py\n")
    (work / "logs").mkdir()


def run(kit: Path | None, out: Path, s: Settings) -> int:
    sp = Sprint(kit=kit, out=out, s=s)
    fresh_work(sp.work)
    print(f"gpu_sprint: DEVICE={s.device} BUDGET_S={s.budget_s:.0f} WORK={sp.work}", flush=True)
    if install(sp) and environment(sp):
        cuda_check(sp)
        have_data = datagen(sp)
        t0 = time.monotonic()
        have_draft = train(sp) if have_data else sp.record("train", None, t0, "no data")
        doctor(sp, have_draft)
        tau(sp, have_draft)
    pack(sp)
    fails = sum(x.status == "FAIL" for x in sp.stages)
    print(f"gpu_sprint: {sum(x.status == 'PASS' for x in sp.stages)} PASS, {fails} FAIL, "
          f"{sum(x.status == 'SKIP' for x in sp.stages)} SKIP in {time.monotonic() - sp.t0:.0f} s; "
          f"{', '.join(sorted(p.name for p in out.iterdir()))} in {out}", flush=True)
    return 1 if fails else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="what is staged of the kit (every part's digest checked)")
    c.add_argument("kit")
    r = sub.add_parser("run", help="install the kit and run every stage")
    r.add_argument("kit", nargs="?", help="the kit folder (none: use the eyas this python has, after `make setup`)")
    r.add_argument("--out", default=os.environ.get("OUT") or "sprint-out", help="where the results go ($OUT)")
    args = ap.parse_args()
    try:
        if args.cmd == "check":
            return check(Path(args.kit))
        return run(Path(args.kit).resolve() if args.kit else None, Path(args.out).resolve(),
                   Settings.from_env(dict(os.environ)))
    except KitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
