"""Prompt sources: the arithmetic generator and JSONL / Parquet datasets (resume, epochs, errors)."""
import dataclasses
import json
from types import SimpleNamespace

import pytest

from megarl.tasks.prompts import (
    ArithmeticSource,
    BadPrompt,
    DatasetSource,
    Prompt,
    chat_renderer,
    has_chat_template,
    make_prompt_source,
)

pytestmark = pytest.mark.unit

ROWS = [{"question": f"q{i}", "solution": i * 10, "level": i % 3} for i in range(7)]


def task(**overrides):
    base = dict(name="arithmetic", path=None, prompt_key="prompt", answer_key="answer", shuffle=True,
                max_operand=9, seed=0, chat_template=False)
    return SimpleNamespace(**{**base, **overrides})


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_arithmetic_source_has_checkable_answers_and_resumes():
    source = make_prompt_source(task(max_operand=5, seed=3))
    first = source.next_batch(4)
    assert all(isinstance(p, Prompt) for p in first)
    for p in first:
        a, b = p.text.removesuffix("=").split("+")
        assert int(a) + int(b) == int(p.answer) and max(int(a), int(b)) <= 5
    state = json.loads(json.dumps(source.state_dict()))  # survives a JSON checkpoint
    expected = source.next_batch(6)
    resumed = ArithmeticSource(max_operand=5, seed=99)
    resumed.load_state_dict(state)
    assert resumed.next_batch(6) == expected


def test_jsonl_dataset_fields_epochs_and_resume(tmp_path):
    path = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    source = make_prompt_source(task(name="jsonl", path=str(path), prompt_key="question", answer_key="solution",
                                     seed=1))
    epoch0 = source.next_batch(7)
    assert sorted(p.text for p in epoch0) == [f"q{i}" for i in range(7)]  # every row once per epoch
    assert [p.text for p in epoch0] != [f"q{i}" for i in range(7)]  # shuffled
    p = next(p for p in epoch0 if p.text == "q4")
    assert p.answer == "40" and dict(p.metadata) == {"level": 1}
    source.next_batch(3)  # into epoch 1
    state = json.loads(json.dumps(source.state_dict()))
    assert state == {"epoch": 1, "index": 3}
    expected = source.next_batch(9)  # crosses into epoch 2
    resumed = DatasetSource(path, prompt_key="question", answer_key="solution", seed=1)
    resumed.load_state_dict(state)
    assert resumed.next_batch(9) == expected


def test_parquet_dataset_in_file_order_without_answers(tmp_path):
    import datasets

    path = tmp_path / "prompts.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    source = make_prompt_source(task(name="parquet", path=str(path), prompt_key="question", answer_key="",
                                     shuffle=False))
    batch = source.next_batch(8)
    assert [p.text for p in batch] == [f"q{i}" for i in range(7)] + ["q0"]
    assert batch[2].answer is None and dict(batch[2].metadata) == {"solution": 20, "level": 2}


def test_missing_field_names_the_field_and_the_file(tmp_path):
    path = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"prompts\.jsonl: no field 'prompt' \(prompt_key\); the rows have fields "
                                         r"\['question', 'solution', 'level'\]"):
        DatasetSource(path)
    with pytest.raises(ValueError, match=r"prompts\.jsonl: no field 'answer' \(answer_key\)"):
        DatasetSource(path, prompt_key="question")


def test_rows_without_a_prompt_and_bad_files_are_clear_errors(tmp_path):
    path = write_jsonl(tmp_path / "holes.jsonl", [{"prompt": "a", "answer": 1}, {"prompt": None, "answer": 2}])
    source = DatasetSource(path, shuffle=False)
    with pytest.raises(ValueError, match=r"holes\.jsonl: row 1 has no string 'prompt' \(got NoneType\)"):
        source.next_batch(2)
    with pytest.raises(FileNotFoundError, match="nope.jsonl does not exist"):
        DatasetSource(tmp_path / "nope.jsonl")
    (tmp_path / "prompts.csv").write_text("prompt,answer\na,1\n")
    with pytest.raises(ValueError, match="cannot tell the format"):
        DatasetSource(tmp_path / "prompts.csv")
    with pytest.raises(ValueError, match="task.path: task jsonl needs the dataset file"):
        make_prompt_source(task(name="jsonl"))


def test_chat_messages_are_rendered_by_the_tokenizers_template(tmp_path, tokenizer, tiny_checkpoint):
    """verl / slime store DAPO-Math's prompts as chat messages: rendered with the tokenizer's template
    (a plain string as one user turn), refused with a pointer to task.chat_template when not asked."""
    messages = [{"role": "system", "content": "sums"}, {"role": "user", "content": "3+4="}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": messages, "label": "7"}, {"prompt": "5+5=", "label": "10"}])
    chat = task(name="jsonl", path=str(path), answer_key="label", shuffle=False, chat_template=True)
    texts = [p.text for p in make_prompt_source(chat, tokenizer).next_batch(2)]
    assert texts == [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                     for m in (messages, [{"role": "user", "content": "5+5="}])]
    assert texts[1] == "<|bos|>U:5+5=\nA:"  # the tiny template, written out
    prompts = make_prompt_source(chat, tokenizer).next_batch(2)
    assert [p.plain_text for p in prompts] == ["system: sums\n\nuser: 3+4=", "5+5="]  # what a judge reads
    assert Prompt(**dataclasses.asdict(prompts[0])) == prompts[0]  # as the producer's checkpoint stores it
    with pytest.raises(ValueError, match=r"row 0's 'prompt' is a list .*set task.chat_template=true"):
        make_prompt_source(task(name="jsonl", path=str(path), answer_key="label", shuffle=False)).next_batch(1)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": ["3+4="], "label": "7"}])
    with pytest.raises(ValueError, match=r"bad.jsonl: row 0: a prompt to render is a string or a list of"):
        DatasetSource(bad, answer_key="label", render=chat_renderer(tokenizer)).next_batch(1)
    assert has_chat_template(tiny_checkpoint)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    assert not has_chat_template(tmp_path / "plain")


def test_a_row_that_is_no_prompt_is_refused_and_left_behind(tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": 5, "answer": "5"}, {"prompt": "2+2=", "answer": "4"}]
    source = DatasetSource(write_jsonl(tmp_path / "rows.jsonl", rows), shuffle=False)
    assert source.next_batch(1)[0].text == "1+1="
    with pytest.raises(BadPrompt, match=r"rows.jsonl: row 1 has no string 'prompt' \(got int\)"):
        source.next_batch(1)
    assert source.next_batch(1)[0].text == "2+2="  # the bad row was drawn, not retried
    assert source.state_dict()["index"] == 3
