"""Data layer: the character tokenizer, arithmetic task, exact-answer reward, prompt files."""

import json
import random
import re

import pytest

from spectrain.errors import ConfigError
from spectrain.tasks.arithmetic import ArithmeticTask, Example
from spectrain.tasks.rewards import exact_answer_reward, extract_answer, get_reward_fn
from spectrain.tasks.sources import FilePrompts, PromptFileError, build_prompt_source
from spectrain.tasks.tokenizer import (
    CHARSET,
    CharTokenizer,
    build_char_tokenizer,
    save_tokenizer,
)

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


def test_char_tokenizer_prompts_are_plain_text():
    tok = CharTokenizer()
    assert tok.encode_prompt("1+2=") == tok.encode("1+2=") == [tok.bos_id, 5, 14, 6, 17]
    assert tok.stop_ids == [tok.eos_id] == [2]
    with pytest.raises(ConfigError, match="the character tokenizer has no chat template"):
        tok.encode_prompt([{"role": "user", "content": "1+2="}])


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
    with pytest.raises(ValueError, match="unknown reward function 'exact'; valid names: custom, exact_answer, "
                                         "math_verify"):
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
    '["1+1=", "2"]': "expected an object, got list",
    '{"prompt": "1+1="}': "missing key(s) 'answer'",
    '{"prompt": "1+1=", "answer": [2]}': "'answer' must be a string or a number, got list",
    '{"prompt": "  ", "answer": "2"}': "'prompt' is empty",
    '{"prompt": "1+1=\\u00e9", "answer": "2"}': "cannot encode: '\u00e9'",
}


def write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_good_jsonl_loads_and_samples_by_rng(tmp_path):
    lines = [json.dumps(row) for row in GOOD]
    path = write_jsonl(tmp_path / "p.jsonl", [lines[0], "", lines[1], "   ", lines[2]])
    prompts = FilePrompts(path)
    assert list(prompts) == [
        Example("12+34=", "46"), Example("What is 2*3?", "6", "2*3;6"), Example("5+5=", "10")]
    rows = sorted(row["prompt"] for row in GOOD)
    assert sorted(e.prompt for e in prompts.sample(3)) == rows  # no repeats within a call
    seven = [e.prompt for e in prompts.sample(7)]
    assert sorted(seven[:3]) == sorted(seven[3:6]) == rows  # whole passes when n > rows
    assert FilePrompts(path, seed=3).sample(7) == FilePrompts(path, seed=3).sample(7)
    # a pure function of the rng: earlier draws do not shift later ones (resume-safe)
    assert prompts.sample(5, random.Random(1)) == prompts.sample(5, random.Random(1))


def test_bad_rows_stop_with_file_and_line_numbers(tmp_path):
    lines = [json.dumps(GOOD[0]), *BAD_LINES]
    path = write_jsonl(tmp_path / "p.jsonl", lines)
    with pytest.raises(PromptFileError) as info:
        FilePrompts(path, on_bad_row="error")
    message = str(info.value)
    assert f"{len(BAD_LINES)} bad rows in {path}" in message and "data.on_bad_row=skip" in message
    shown = list(BAD_LINES.values())[:5]  # the message lists the first five
    for lineno, expected in enumerate(shown, start=2):
        assert re.search(rf"{re.escape(str(path))}:{lineno}: .*{re.escape(expected)}", message)
    assert "... and 1 more" in message


@pytest.mark.parametrize("line,expected", list(BAD_LINES.items()))
def test_each_bad_row_says_what_is_wrong(tmp_path, line, expected):
    path = write_jsonl(tmp_path / "p.jsonl", [json.dumps(GOOD[0]), line])
    with pytest.raises(PromptFileError, match=rf"p\.jsonl:2: .*{re.escape(expected)}"):
        FilePrompts(path, on_bad_row="error")


def test_bad_rows_are_skipped_with_a_summary_warning(tmp_path):
    lines = [json.dumps(GOOD[0]), *BAD_LINES, json.dumps(GOOD[2])]
    path = write_jsonl(tmp_path / "p.jsonl", lines)
    with pytest.warns(UserWarning, match=rf"skipped {len(BAD_LINES)} of {len(lines)} rows") as rec:
        prompts = FilePrompts(path, on_bad_row="skip")
    assert [e.prompt for e in prompts] == ["12+34=", "5+5="]
    assert (prompts.skipped_bad, prompts.dropped_overlong) == (len(BAD_LINES), 0)
    assert f"{path}:2: invalid JSON" in str(rec[0].message)


def test_file_without_valid_rows_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", list(BAD_LINES)[:2])
    with pytest.raises(PromptFileError, match=r"no valid rows in .*bad\.jsonl \(2 bad rows\)"):
        FilePrompts(path, on_bad_row="skip")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(PromptFileError, match="the file is empty"):
        FilePrompts(empty)


def test_invalid_utf8_and_bad_on_bad_row(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(json.dumps(GOOD[0]).encode() + b'\n{"prompt": "\xff", "answer": "1"}\n')
    with pytest.raises(PromptFileError, match=r"p\.jsonl:2: not valid UTF-8"):
        FilePrompts(path, on_bad_row="error")
    with pytest.raises(ValueError, match="data.on_bad_row must be 'skip' or 'error'"):
        FilePrompts(path, on_bad_row="ignore")


def test_build_prompt_source(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [json.dumps(GOOD[0])])
    assert len(build_prompt_source("files", files=path)) == 1
    assert len(build_prompt_source("files", files=[str(path), path])) == 2
    task = build_prompt_source("arithmetic", digits=2, seed=4)
    assert task.sample(3) == ArithmeticTask(digits=2, seed=4).sample(3)
    with pytest.raises(ValueError, match="unknown prompt source 'csv'; valid kinds: arithmetic, files"):
        build_prompt_source("csv")


def write_parquet(path, rows):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


VERL_ROWS = [  # verl's gsm8k parquet layout: chat-message prompts, the answer nested and numeric here
    {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "What is 2*3?"}],
     "reward_model": {"style": "rule", "ground_truth": 6}, "extra_info": {"index": 0}},
    {"data_source": "gsm8k", "prompt": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Half of 3?"}],
     "reward_model": {"style": "rule", "ground_truth": 1.5}, "extra_info": {"index": 1}},
]


def test_parquet_with_nested_keys_chat_prompts_and_numeric_answers(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", VERL_ROWS)
    rows = FilePrompts(path, answer_key="reward_model.ground_truth", tokenizer=_ChatStandIn()).examples
    assert rows == [Example(({"role": "user", "content": "What is 2*3?"},), "6"),
                    Example(({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Half of 3?"}),
                            "1.5")]
    with pytest.raises(ConfigError, match="no chat template"):  # found when loading, not mid-run
        FilePrompts(path, answer_key="reward_model.ground_truth")


class _ChatStandIn(CharTokenizer):
    """The character tokenizer with a trivial chat format, so chat rows load without a real template."""

    def encode_prompt(self, prompt):
        return self.encode(prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt))


def test_missing_key_names_the_config_key_and_what_the_file_has(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", VERL_ROWS)
    with pytest.raises(PromptFileError, match=r"data.answer_key: no row of .*train\.parquet has the key 'answer'; "
                                              r"its rows have: data_source, prompt, reward_model, "
                                              r"reward_model.style, reward_model.ground_truth, extra_info"):
        FilePrompts(path, tokenizer=_ChatStandIn())
    jsonl = write_jsonl(tmp_path / "p.jsonl", [json.dumps({"question": "1+1=", "answer": "2"})])
    with pytest.raises(PromptFileError, match=r"data.prompt_key: no row of .*p\.jsonl has the key 'prompt'"):
        FilePrompts([jsonl])


def test_jsonl_and_parquet_together_with_a_template_and_numbers(tmp_path):
    jsonl = write_jsonl(tmp_path / "a.jsonl", [json.dumps({"q": "1+1", "a": 2, "sol": "1+1;2"})])
    parquet = write_parquet(tmp_path / "b.parquet", [{"q": "2+2", "a": "4", "sol": None}])
    prompts = FilePrompts([jsonl, str(parquet)], prompt_key="q", answer_key="a", target_key="sol",
                          prompt_template="Q: {prompt}=")
    assert prompts.examples == [Example("Q: 1+1=", "2", "1+1;2"), Example("Q: 2+2=", "4")]
    with pytest.raises(PromptFileError, match=r"data.prompt_template 'Q: \{q\}' has no \{prompt\}"):
        FilePrompts(jsonl, prompt_key="q", answer_key="a", prompt_template="Q: {q}")
    with pytest.raises(PromptFileError, match=r"unknown file type '\.csv'"):
        FilePrompts(tmp_path / "c.csv")


def test_overlong_prompts_are_dropped_and_counted_or_refused(tmp_path):
    lines = [json.dumps({"prompt": "1" * length, "answer": "1"}) for length in (3, 9, 4, 12)]
    path = write_jsonl(tmp_path / "p.jsonl", lines)
    with pytest.warns(UserWarning, match=r"dropped 2 of 4 rows in .*p\.jsonl .*data.max_prompt_length=5"):
        prompts = FilePrompts(path, max_prompt_length=5)  # <bos> + 4 characters fit
    assert [e.prompt for e in prompts] == ["111", "1111"] and prompts.dropped_overlong == 2
    with pytest.raises(PromptFileError, match=r"p\.jsonl:2: the prompt has 10 tokens, more than "
                                              r"data.max_prompt_length=5.*filter_overlong_prompts=true"):
        FilePrompts(path, max_prompt_length=5, filter_overlong_prompts=False)
    with pytest.raises(PromptFileError, match=r"every prompt in .*p\.jsonl is longer than data.max_prompt_length=2"):
        FilePrompts(path, max_prompt_length=2)


def test_a_json_file_holds_an_array_of_rows_or_json_lines(tmp_path):
    array = tmp_path / "array.json"
    array.write_text(json.dumps(GOOD, indent=2))  # one JSON document over many lines
    assert list(FilePrompts(array)) == [
        Example("12+34=", "46"), Example("What is 2*3?", "6", "2*3;6"), Example("5+5=", "10")]
    lines = write_jsonl(tmp_path / "lines.json", [json.dumps(row) for row in GOOD])
    assert list(FilePrompts(lines)) == list(FilePrompts(array))
    array.write_text(json.dumps([GOOD[0], {"prompt": "1+1="}, 3]))
    with pytest.raises(PromptFileError, match=r"2 bad rows in .*array\.json:\n  .*array\.json:\[1\]: missing key\(s\) "
                                              r"'answer'.*\n  .*array\.json:\[2\]: expected an object, got int"):
        FilePrompts(array, on_bad_row="error")
    array.write_text(json.dumps({"data": GOOD}, indent=2))
    with pytest.raises(PromptFileError, match=r"array\.json is neither a JSON array of rows nor JSON lines \(it holds "
                                              r"one JSON object\)"):
        FilePrompts(array)


# --- the draft vocabulary, checked against the train completions it is picked from -------------------------


def check_draft_vocab(size: int) -> None:
    from spectrain.config import load_config
    from spectrain.train.inputs import check_draft_vocab as check

    tokenizer = CharTokenizer()
    check(load_config(None, [f"draft.draft_vocab_size={size}"]), tokenizer.vocab_size, ArithmeticTask(seed=0),
          tokenizer)


def test_a_draft_vocabulary_that_covers_few_train_tokens_is_warned_about(recwarn):
    with pytest.warns(UserWarning, match=r"\[spectrain\] draft\.draft_vocab_size=4 covers only \d+\.\d% of the train "
                                         r"completions' tokens: the draft can never propose the other \d+\.\d%, so "
                                         r"acceptance is bounded; raise it \((\d+) ids cover 90%\)") as record:
        check_draft_vocab(4)
    enough = int(re.search(r"\((\d+) ids cover", str(record[0].message)).group(1))
    recwarn.clear()
    check_draft_vocab(enough)  # the size it suggests is the smallest that covers enough
    assert not [w for w in recwarn if "draft_vocab_size" in str(w.message)]
    with pytest.warns(UserWarning, match=rf"draft_vocab_size={enough - 1} covers only"):
        check_draft_vocab(enough - 1)
    with pytest.raises(ConfigError, match=r"draft\.draft_vocab_size: is \d+, more than the policy's \d+ tokens"):
        check_draft_vocab(CharTokenizer().vocab_size + 1)
