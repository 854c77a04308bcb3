import copy
import json
from collections import Counter

import pytest
import torch

from eyas.data.conversations import (
    Conversation,
    DataError,
    _iter_json_array,
    load_conversations,
    loop_end,
    masked_spans,
    tokenize_conversation,
    tokenize_conversation_checked,
)


def sharegpt_rows():
    """Rows covering every normalisation and skip rule; the expected outcome is next to each."""
    return [
        {"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]},  # ok 0
        {"id": "b", "conversations": [{"from": "gpt", "value": "leading reply"}, {"from": "human", "value": "Q"},
                                      {"from": "chatgpt", "value": "A"}, {"from": "human", "value": "trailing"}]},  # ok
        {"id": "c", "conversations": [{"from": "human", "value": "x"}, {"from": "robot", "value": "y"}]},  # unknown
        {"id": "d", "conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "y"}]},  # empty
        {"id": "e", "conversations": [{"from": "human", "value": "no answer"}]},  # no_assistant_turn
        "not a dict",  # malformed
        {"id": "f", "conversations": [{"from": "system", "value": "Be terse."}, {"from": "user", "value": "Q2"},
                                      {"from": "bard", "value": "A2"}]},  # ok
        {"id": "g", "conversations": [{"from": "human"}]},  # malformed (no value)
        {"id": "h", "conversations": []},  # no_assistant_turn
    ]


EXPECTED_SKIPS = Counter({"unknown_role": 1, "empty_message": 1, "no_assistant_turn": 2, "malformed": 2})


def check_rows(convs, skipped, ids=(0, 1, 6)):
    assert [c.row_id for c in convs] == list(ids)
    assert skipped == EXPECTED_SKIPS
    assert convs[0].messages == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    # the leading assistant turn is dropped (and counted), the trailing user turn carries no loss: cut
    assert convs[1].messages == [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    assert convs[1].dropped_turns == 1 and convs[0].dropped_turns == 0
    assert [m["role"] for m in convs[2].messages] == ["system", "user", "assistant"]


def test_sharegpt_json_array(tmp_path):
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(sharegpt_rows(), indent=2))
    check_rows(*load_conversations(str(p)))
    convs, _ = load_conversations(str(p), num=2)
    assert [c.row_id for c in convs] == [0, 1]


def test_sharegpt_jsonl_with_bad_lines(tmp_path):
    p = tmp_path / "sg.jsonl"
    lines = [json.dumps(r) for r in sharegpt_rows()]
    lines.insert(3, "{this is not json")  # row id 3 becomes invalid_json; later rows shift by one
    p.write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n")  # a blank line has no row id
    convs, skipped = load_conversations(str(p))
    assert [c.row_id for c in convs] == [0, 1, 7]
    assert skipped == EXPECTED_SKIPS + Counter({"invalid_json": 1})


def test_openai_messages_jsonl(tmp_path):
    rows = [
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                      {"role": "assistant", "content": "A"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "part1 "}, {"type": "text", "text": "p2"}]},
                      {"role": "assistant", "content": "B"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                      {"role": "assistant", "content": "C"}]},  # non-text content: malformed
        {"messages": [{"role": "tool", "content": "t"}, {"role": "assistant", "content": "D"}]},  # unknown role
    ]
    p = tmp_path / "oa.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    convs, skipped = load_conversations(str(p))
    assert [c.row_id for c in convs] == [0, 1]
    assert convs[0].messages[0] == {"role": "system", "content": "S"}
    assert convs[1].messages[0]["content"] == "part1 p2"
    assert skipped == Counter({"malformed": 1, "unknown_role": 1})


def test_truncated_array_keeps_every_whole_row(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": f"q{i} " * (i + 1)}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(6)]
    text = json.dumps(rows, indent=1)
    cut = text.index('"q5')  # inside the last object
    p = tmp_path / "trunc.json"
    p.write_text(text[:cut])
    convs, skipped = load_conversations(str(p))
    assert [c.row_id for c in convs] == [0, 1, 2, 3, 4]
    assert skipped == Counter({"truncated_tail": 1})
    # streamed parsing agrees with json.loads for every buffer size, including ones smaller than a row
    p.write_text(text)
    for chunk in (5, 64, 1 << 20):
        assert [obj for _, obj in _iter_json_array(p, chunk_chars=chunk)] == rows


def test_bundled_sharegpt_first_rows_and_tail():
    convs, skipped = load_conversations("sharegpt", num=5)
    assert len(convs) == 5 and sum(skipped.values()) == convs[-1].row_id + 1 - 5
    assert convs[0].row_id == 0
    assert convs[0].messages[0]["content"].startswith("Summarize the main ideas of Jeff Walker's Product Launch")
    assert [m["role"] for m in convs[0].messages[:4]] == ["user", "assistant", "user", "assistant"]
    again, _ = load_conversations("sharegpt", num=5)  # deterministic
    assert [c.messages for c in again] == [c.messages for c in convs]


def test_bundled_sharegpt_whole_file_stops_at_truncated_tail():
    convs, skipped = load_conversations("sharegpt")
    assert len(convs) > 17_000  # ~17.6k whole rows, minus the unusable ones
    assert skipped["truncated_tail"] == 1
    ids = [c.row_id for c in convs]
    assert ids == sorted(set(ids))


@pytest.mark.parametrize("content,match", [
    ('{"foo": 1, "bar": [1, 2]}\n', "not a conversation file"),
    ("a,b,c\n1,2,3\n", "not a conversation file"),
    ("[1, 2, 3]", "not a conversation file"),
    ("", "not a conversation file"),
])
def test_not_a_conversation_file_is_an_error(tmp_path, content, match):
    p = tmp_path / "x.data"
    p.write_text(content)
    with pytest.raises(DataError, match=match):
        load_conversations(str(p))


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_conversations(str(tmp_path / "nope.jsonl"))


MULTI = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue, like the sky.\n\nAlso: red!"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": " You're welcome."},
]


def test_loss_mask_decodes_to_exactly_the_assistant_replies(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids, mask, exact = tokenize_conversation_checked(tok, MULTI)
    assert exact
    assert ids.tolist() == tok(tok.apply_chat_template(MULTI, tokenize=False), add_special_tokens=False)["input_ids"]
    spans = [s.text for s in masked_spans(tok, ids, mask)]
    assert spans == [m["content"] + "<|im_end|>" for m in MULTI if m["role"] == "assistant"]
    unmasked = tok.decode(ids[~mask].tolist())
    for m in MULTI:
        if m["role"] != "assistant":
            assert m["content"] in unmasked
    assert unmasked.count("<|im_start|>assistant\n") == 3  # the header is never a loss token
    ids2, mask2 = tokenize_conversation(tok, MULTI, max_len=20)
    assert torch.equal(ids2, ids[:20]) and torch.equal(mask2, mask[:20])


def test_loss_mask_when_bpe_merges_across_the_header(smollm2_tokenizer):
    tok = smollm2_tokenizer
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\n\nok then"}]
    ids, mask, exact = tokenize_conversation_checked(tok, msgs)
    assert not exact  # the header's '\n' merges with the reply's '\n\n'
    assert ids.tolist() == tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]
    spans = [s.text for s in masked_spans(tok, ids, mask)]
    assert len(spans) == 1 and spans[0].endswith("ok then<|im_end|>") and "assistant" not in spans[0]


def test_template_that_rewrites_history_is_refused(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    # a template that drops earlier assistant replies (as reasoning templates drop their thinking)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
                         "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(DataError, match="prefix-consistent"):
        tokenize_conversation(tok, MULTI)


def test_loop_end():
    assert loop_end([1, 2, 3] * 20, 8) == 11  # period 3: tokens[3:11] == tokens[0:8]
    assert loop_end([5] * 10, 4) == 5
    assert loop_end(list(range(50)), 4) is None
    assert loop_end([7, 7, 7, 7], 0) is None  # disabled
    seq = [9, 8] + [1, 2, 3, 4] * 3
    assert loop_end(seq, 4) == 2 + 8  # the second copy of the 4-token loop completes at length 10
    assert loop_end(list(range(10)) * 3, 4) == 14  # a period-10 loop, longer than n: caught after 10 + 4
    assert loop_end([1, 2, 3, 1, 2, 4, 1, 2, 5], 3) is None  # shorter repeats than n are fine


def test_conversation_contract():
    c = Conversation(row_id=3, messages=[{"role": "user", "content": "x"}])
    assert c.row_id == 3 and c.dropped_turns == 0


def test_text_that_is_not_utf8_skips_its_row_as_invalid_utf8(tmp_path):
    """Undecodable bytes in a row's text (or a lone-surrogate JSON escape) skip that row and count it; the rows
    around it, valid non-ASCII text included, are read as they are, in JSONL and in a JSON array."""
    def row(user: str, reply: str = "fine") -> bytes:
        return json.dumps({"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": reply}]},
                          ensure_ascii=False).encode()

    lines = [row("héllo ✓ 你好"),  # 0: valid UTF-8, kept as written
             row("caf@").replace(b"@", b"\xe9"),  # 1: a Latin-1 byte: not UTF-8
             row("q").replace(b"fine", b"\\ud800"),  # 2: a lone-surrogate escape: valid JSON, not text
             b'{"text": "doc \xff\xfe"}',  # 3: a plain-text row with bad bytes
             b'{"conversations": [{"from": "hu\xffman", "value": "q"}, {"from": "gpt", "value": "a"}]}',  # 4: role
             row("last")]
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b"\n".join(lines) + b"\n")
    convs, skipped = load_conversations(str(p))
    assert [c.row_id for c in convs] == [0, 5] and skipped == Counter({"invalid_utf8": 4})
    assert convs[0].messages[0]["content"] == "héllo ✓ 你好"
    arr = tmp_path / "bad.json"
    arr.write_bytes(b"[" + b",\n".join(lines[:3] + lines[4:]) + b"]")
    convs, skipped = load_conversations(str(arr))
    assert [c.row_id for c in convs] == [0, 4] and skipped == Counter({"invalid_utf8": 3})
