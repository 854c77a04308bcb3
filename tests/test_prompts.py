from __future__ import annotations

import json
from collections import Counter

import pytest

from eyas.bench.prompts import PromptError, load_prompts, mtbench_questions


def test_mtbench_80_questions_two_turns_categories():
    rows = mtbench_questions()
    assert len(rows) == 80
    assert all(len(r["turns"]) == 2 for r in rows)
    assert Counter(r["category"] for r in rows) == {c: 10 for c in (
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")}
    prompts = load_prompts("mt-bench")
    assert len(prompts) == 80 and len({p.id for p in prompts}) == 80
    assert all(p.messages == [{"role": "user", "content": p.turns[0]}] for p in prompts)


def test_mtbench_subset_is_stratified_and_deterministic():
    a = load_prompts("mt-bench", limit=10)
    assert [p.id for p in a] == [p.id for p in load_prompts("mt-bench", limit=10)]
    assert len({p.category for p in a[:8]}) == 8  # the first 8 cover every category once
    assert a[8].category == a[0].category and a[9].category == a[1].category


def test_mtbench_turn2_carries_first_answer():
    seen = []

    def answer(messages):
        seen.append(messages)
        return f"answer {len(seen)}"

    prompts = load_prompts("mt-bench", limit=3, turn=2, answer=answer)
    assert len(seen) == 3
    for i, p in enumerate(prompts):
        assert [m["role"] for m in p.messages] == ["user", "assistant", "user"]
        assert p.messages[0]["content"] == p.turns[0] and p.messages[2]["content"] == p.turns[1]
        assert p.messages[1]["content"] == f"answer {i + 1}"
        assert p.id.endswith("-t2")
    with pytest.raises(PromptError, match="needs the first turn's answer"):
        load_prompts("mt-bench", limit=1, turn=2)
    with pytest.raises(PromptError, match="only for mt-bench"):
        load_prompts("humaneval", turn=2, answer=answer)


def test_humaneval_164_problems_with_code():
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164
    assert prompts[0].id == "HumanEval/0" and prompts[163].id == "HumanEval/163"
    assert "def has_close_elements(" in prompts[0].messages[0]["content"]
    assert [p.id for p in load_prompts("humaneval", limit=2)] == ["HumanEval/0", "HumanEval/1"]


def test_jsonl_prompts_and_messages(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join([
        json.dumps({"prompt": "hello", "category": "greet"}),
        "",
        json.dumps({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
                    "id": "sum"}),
        json.dumps({"prompt": "third"}),
    ]))
    prompts = load_prompts(str(f))
    assert [(p.id, p.category) for p in prompts] == [("line-1", "greet"), ("sum", "default"), ("line-4", "default")]
    assert prompts[1].messages[-1] == {"role": "user", "content": "2+2?"}
    assert len(load_prompts(str(f), limit=2)) == 2


@pytest.mark.parametrize("line,match", [
    ("{not json", "line 2 is not valid JSON"),
    (json.dumps({"text": "x"}), "line 2: expected exactly one of"),
    (json.dumps({"messages": [{"role": "bot", "content": "x"}]}), r"line 2: messages\[0\]"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}),
     "line 2: the last message must be the user turn"),
    (json.dumps(["a"]), "line 2: expected a JSON object"),
])
def test_bad_jsonl_names_the_line(tmp_path, line, match):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"prompt": "ok"}) + "\n" + line + "\n")
    with pytest.raises(PromptError, match=match):
        load_prompts(str(f))


def test_unknown_set_and_bad_limit(tmp_path):
    with pytest.raises(PromptError, match="not one of"):
        load_prompts("mt-bench-2")
    with pytest.raises(PromptError, match="--limit"):
        load_prompts("mt-bench", limit=0)
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(PromptError, match="holds no prompts"):
        load_prompts(str(tmp_path / "e.jsonl"))
