"""Data layer of the embedded recipe: tokenizer, arithmetic task, rewards, prompt files."""

import json
import random
import re

import pytest

from spectrain.tasks.arithmetic import ArithmeticTask, Example
from spectrain.tasks.sources import (
    JsonlPrompts,
    PromptFileError,
    build_prompt_source,
    load_jsonl_examples,
)
from spectrain.tasks.tokenizer import (
    CHARSET,
    CharTokenizer,
    build_char_tokenizer,
    save_tokenizer,
)
from spectrain.tasks.rewards import exact_answer_reward, extract_answer, get_reward_fn

TEXTS = [
    "047+385=7+5+0=12,4+8+1=13,0+3+1=04;432",
    "Hello, World!\n  two  spaces (a/b) 'q' \"dq\" x:y; ok? 3*4-1",
    " leading and trailing \n",
    CHARSET,
]


# --- tokenizer ---------------------------------------------------------------------------


def test_vocab_is_small_fixed_and_deterministic():
    tok = CharTokenizer()
    assert tok.vocab_size == 4 + len(CHARSET) <= 128
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert build_char_tokenizer().to_str() == build_char_tokenizer().to_str()


@pytest.mark.parametrize("text", TEXTS)
def test_char_tokenizer_round_trip(text):
    tok = CharTokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and len(ids) == len(text) + 1  # one token per character
    assert tok.encode(text, add_bos=False) == ids[1:]
    assert tok.decode(ids) == text


def test_unknown_characters_map_to_unk_and_are_reported():
    tok = CharTokenizer()
    assert tok.encode("a\u00e9b", add_bos=False) == [*tok.encode("a", add_bos=False), tok.unk_id,
                                                     *tok.encode("b", add_bos=False)]
    assert tok.unknown_chars("a\u00e9<b\t") == ["\t", "<", "\u00e9"]
    assert tok.unknown_chars(CHARSET) == []


def test_auto_tokenizer_loads_saved_files(tmp_path):
    transformers = pytest.importorskip("transformers")
    files = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    save_tokenizer(tmp_path / "a")
    CharTokenizer().save_pretrained(tmp_path / "b")  # the name hf_io.save_pretrained calls
    assert {p.name for p in (tmp_path / "a").iterdir()} == files
    assert all((tmp_path / "a" / f).read_text() == (tmp_path / "b" / f).read_text() for f in files)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    ours = CharTokenizer()
    assert isinstance(hf, transformers.PreTrainedTokenizerFast)
    assert (hf.bos_token, hf.eos_token, hf.pad_token, hf.unk_token) == (
        "<bos>", "<eos>", "<pad>", "<unk>")
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id) == (1, 2, 0, 3)
    assert len(hf) == ours.vocab_size
    for text in TEXTS:
        ids = hf.encode(text)
        assert ids == ours.encode(text)  # vLLM and the trainer see the same ids
        assert hf.decode(ids, skip_special_tokens=True) == text
    assert hf.decode([1, 5, 6, 2]) == "<bos>12<eos>"


# --- arithmetic task ---------------------------------------------------------------------


def test_worked_format_of_a_known_example():
    ex = ArithmeticTask(digits=3, operands=2).example([47, 385])
    assert ex == Example("047+385=", "432", "7+5+0=12,4+8+1=13,0+3+1=04;432")
    ex = ArithmeticTask(digits=2, operands=3).example([99, 99, 99])
    assert ex == Example("99+99+99=", "297", "9+9+9+0=27,9+9+9+2=29;297")


def test_task_is_deterministic_by_seed():
    assert ArithmeticTask(seed=1).sample(20) == ArithmeticTask(seed=1).sample(20)
    assert ArithmeticTask(seed=1).sample(20) != ArithmeticTask(seed=2).sample(20)
    task = ArithmeticTask()
    assert task.sample(5, random.Random(7)) == task.sample(5, random.Random(7))


@pytest.mark.parametrize("digits,operands", [(1, 2), (2, 2), (3, 2), (3, 3), (5, 4)])
def test_answers_and_worked_targets_are_correct(digits, operands):
    task = ArithmeticTask(digits=digits, operands=operands, seed=digits * 10 + operands)
    tok = CharTokenizer()
    for ex in task.sample(200):
        numbers = [int(x) for x in ex.prompt.rstrip("=").split("+")]
        assert len(numbers) == operands and all(len(x) == digits for x in ex.prompt[:-1].split("+"))
        assert ex.answer == str(sum(numbers))
        steps, final = ex.target.split(";")
        assert final == ex.answer and len(ex.target) <= task.max_target_chars
        digits_out, carry = [], 0
        for column, step in enumerate(steps.split(",")):
            lhs, total = step.split("=")
            *column_digits, carry_in = map(int, lhs.split("+"))
            assert column_digits == [(x // 10**column) % 10 for x in numbers]
            assert carry_in == carry and int(total) == sum(column_digits) + carry
            carry, digit = divmod(int(total), 10)
            digits_out.append(str(digit))
        assert int(str(carry) + "".join(reversed(digits_out))) == sum(numbers)
        assert exact_answer_reward(ex.target, ex.answer) == 1.0
        assert tok.unknown_chars(ex.prompt + ex.target) == []


def test_task_rejects_bad_difficulty_and_operands():
    with pytest.raises(ValueError, match="digits"):
        ArithmeticTask(digits=0)
    with pytest.raises(ValueError, match="operands"):
        ArithmeticTask(operands=1)
    with pytest.raises(ValueError, match="need 2 integers"):
        ArithmeticTask(digits=2).example([100, 1])


# --- rewards -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion,answer,reward",
    [
        ("7+5+0=12,4+8+1=13,0+3+1=04;432", "432", 1.0),
        ("...;0432", "432", 1.0),  # integers compare by value
        ("... ; 432 \n", "432", 1.0),
        ("432", "432", 1.0),  # no marker: the whole completion is the answer
        ("1;2;432", "432", 1.0),  # the last marker wins
        ("...;433", "432", 0.0),
        ("...;432;", "432", 0.0),
        ("", "432", 0.0),
        ("Paris", "Paris", 1.0),
        ("paris", "Paris", 0.0),
    ],
)
def test_exact_answer_reward(completion, answer, reward):
    assert exact_answer_reward(completion, answer) == reward


def test_partial_credit_is_opt_in_and_below_a_right_answer():
    assert exact_answer_reward(";442", "432") == 0.0
    assert exact_answer_reward(";442", "432", partial_credit=0.3) == pytest.approx(0.3 * 2 / 3)
    assert exact_answer_reward(";32", "432", partial_credit=0.3) == pytest.approx(0.3 * 2 / 3)
    assert exact_answer_reward(";", "432", partial_credit=0.3) == 0.0
    assert exact_answer_reward(";432", "432", partial_credit=0.3) == 1.0
    with pytest.raises(ValueError, match=r"partial_credit must be in \[0, 1\)"):
        exact_answer_reward(";1", "1", partial_credit=1.0)


def test_reward_registry():
    assert extract_answer("a;b; 12 ") == "12"
    assert get_reward_fn("exact_answer")(";5", "5") == 1.0
    shaped = get_reward_fn("exact_answer", partial_credit=0.5)
    assert shaped(";15", "25") == pytest.approx(0.25)
    with pytest.raises(ValueError, match="unknown reward function 'exact'; valid names: exact_answer"):
        get_reward_fn("exact")
    with pytest.raises(ValueError, match="bad options"):
        get_reward_fn("exact_answer", partial=0.5)
    with pytest.raises(ValueError, match="partial_credit must be"):
        get_reward_fn("exact_answer", partial_credit=2.0)


# --- prompt files ------------------------------------------------------------------------

GOOD = [
    {"prompt": "12+34=", "answer": "46"},
    {"prompt": "What is 2*3?", "answer": "6", "target": "2*3;6", "source": "extra keys ignored"},
    {"prompt": "5+5=", "answer": "10"},
]
BAD_LINES = {  # line content -> what the message must say
    '{"prompt": "1+1=", "answer": "2"': "invalid JSON",
    '["1+1=", "2"]': "expected a JSON object, got list",
    '{"prompt": "1+1="}': "missing key(s) 'answer'",
    '{"prompt": "1+1=", "answer": 2}': "'answer' must be a string, got int",
    '{"prompt": "  ", "answer": "2"}': "'prompt' is empty",
    '{"prompt": "1+1=\\u00e9", "answer": "2"}': "cannot encode: '\u00e9'",
}


def write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_good_jsonl_loads_and_samples_by_rng(tmp_path):
    lines = [json.dumps(row) for row in GOOD]
    path = write_jsonl(tmp_path / "p.jsonl", [lines[0], "", lines[1], "   ", lines[2]])
    prompts = JsonlPrompts(path)
    assert list(prompts) == [
        Example("12+34=", "46"), Example("What is 2*3?", "6", "2*3;6"), Example("5+5=", "10")]
    rows = sorted(row["prompt"] for row in GOOD)
    assert sorted(e.prompt for e in prompts.sample(3)) == rows  # no repeats within a call
    seven = [e.prompt for e in prompts.sample(7)]
    assert sorted(seven[:3]) == sorted(seven[3:6]) == rows  # whole passes when n > rows
    assert JsonlPrompts(path, seed=3).sample(7) == JsonlPrompts(path, seed=3).sample(7)
    # a pure function of the rng: earlier draws do not shift later ones (resume-safe)
    assert prompts.sample(5, random.Random(1)) == prompts.sample(5, random.Random(1))


def test_bad_rows_stop_with_file_and_line_numbers(tmp_path):
    lines = [json.dumps(GOOD[0]), *BAD_LINES]
    path = write_jsonl(tmp_path / "p.jsonl", lines)
    with pytest.raises(PromptFileError) as info:
        load_jsonl_examples(path)
    message = str(info.value)
    assert f"{len(BAD_LINES)} bad rows in {path}" in message and "on_bad_row='skip'" in message
    shown = list(BAD_LINES.values())[:5]  # the message lists the first five
    for lineno, expected in enumerate(shown, start=2):
        assert re.search(rf"{re.escape(str(path))}:{lineno}: .*{re.escape(expected)}", message)
    assert "... and 1 more" in message


@pytest.mark.parametrize("line,expected", list(BAD_LINES.items()))
def test_each_bad_row_says_what_is_wrong(tmp_path, line, expected):
    path = write_jsonl(tmp_path / "p.jsonl", [json.dumps(GOOD[0]), line])
    with pytest.raises(PromptFileError, match=rf"p\.jsonl:2: .*{re.escape(expected)}"):
        load_jsonl_examples(path)


def test_bad_rows_are_skipped_with_a_summary_warning(tmp_path):
    lines = [json.dumps(GOOD[0]), *BAD_LINES, json.dumps(GOOD[2])]
    path = write_jsonl(tmp_path / "p.jsonl", lines)
    with pytest.warns(UserWarning, match=rf"skipped {len(BAD_LINES)} of {len(lines)} rows") as rec:
        examples = load_jsonl_examples(path, on_bad_row="skip")
    assert [e.prompt for e in examples] == ["12+34=", "5+5="]
    assert f"{path}:2: invalid JSON" in str(rec[0].message)


def test_file_without_valid_rows_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", list(BAD_LINES)[:2])
    with pytest.raises(PromptFileError, match=r"no valid rows in .*bad\.jsonl \(2 bad rows\)"):
        load_jsonl_examples(path, on_bad_row="skip")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(PromptFileError, match="the file is empty"):
        load_jsonl_examples(empty)


def test_invalid_utf8_and_bad_on_bad_row(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(json.dumps(GOOD[0]).encode() + b'\n{"prompt": "\xff", "answer": "1"}\n')
    with pytest.raises(PromptFileError, match=r"p\.jsonl:2: not valid UTF-8"):
        load_jsonl_examples(path)
    with pytest.raises(ValueError, match="on_bad_row must be 'skip' or 'error'"):
        load_jsonl_examples(path, on_bad_row="ignore")


def test_build_prompt_source(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [json.dumps(GOOD[0])])
    assert len(build_prompt_source("jsonl", path=path)) == 1
    task = build_prompt_source("arithmetic", digits=2, seed=4)
    assert task.sample(3) == ArithmeticTask(digits=2, seed=4).sample(3)
    with pytest.raises(ValueError, match="unknown prompt source 'csv'; valid kinds: arithmetic, jsonl"):
        build_prompt_source("csv")
