"""A checkpoint's own tokenizer: the trainer's prompt ids equal transformers' and vLLM's, stop ids, no double BOS."""

import json
import re
import shutil

import pytest

from spectrain.tasks.hf_tokenizer import HFTokenizer, TokenizerLoadError, build_chatml_bpe_tokenizer
from spectrain.tasks.sources import FilePrompts

transformers = pytest.importorskip("transformers")

TEXTS = [f"Question {i}: Tom has {i} apples and buys {3 * i} more. How many now? "
         f"He has {i} + {3 * i} = {4 * i}. The answer is {4 * i}.\n#### {4 * i}" for i in range(300)]
QUESTION = "Tom has 7 apples and buys 21 more. How many now?"
USER = [{"role": "user", "content": QUESTION}]
THINK_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def write_tokenizer(directory, **options):
    hf = build_chatml_bpe_tokenizer(TEXTS, vocab_size=400, out_dir=directory, **options)
    eos = [hf.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]  # as Qwen3's generation_config
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return directory


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("chatml"))


def test_prompt_ids_equal_transformers_chat_paths(chatml):
    auto = transformers.AutoTokenizer.from_pretrained(str(chatml))
    ids = HFTokenizer(chatml).encode_prompt(QUESTION)
    assert ids == auto.apply_chat_template(USER, add_generation_prompt=True, tokenize=True, return_dict=False)
    rendered = auto.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert ids == auto.encode(rendered, add_special_tokens=False)
    assert auto.decode(ids) == f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    assert HFTokenizer(chatml).encode_prompt(tuple(USER)) == ids  # a file's message rows come as tuples


@pytest.mark.vllm
def test_prompt_ids_equal_vllm_chat_rendering(chatml):
    """vLLM's `LLM.chat` renders with `safe_apply_chat_template` on its own tokenizer wrapper."""
    from types import SimpleNamespace

    from vllm.renderers.hf import safe_apply_chat_template
    from vllm.tokenizers import get_tokenizer

    (chatml / "config.json").write_text(json.dumps({"model_type": "qwen3"}))  # vLLM reads it next to the tokenizer
    model_config = SimpleNamespace(tokenizer=str(chatml), model=str(chatml), tokenizer_revision=None,
                                   code_revision=None, trust_remote_code=False)
    ours = HFTokenizer(chatml, chat_template_kwargs={"enable_thinking": False}, system_prompt="Be brief.")
    vllm_ids = safe_apply_chat_template(model_config, get_tokenizer(str(chatml)), ours.messages(QUESTION),
                                        add_generation_prompt=True, enable_thinking=False)
    assert vllm_ids == ours.encode_prompt(QUESTION)


def test_chat_template_kwargs_and_system_prompt(chatml):
    plain = HFTokenizer(chatml)
    off = HFTokenizer(chatml, chat_template_kwargs={"enable_thinking": False})
    assert off.encode_prompt(QUESTION)[:len(plain.encode_prompt(QUESTION))] == plain.encode_prompt(QUESTION)
    assert off.decode(off.encode_prompt(QUESTION), skip_special_tokens=False).endswith(THINK_OFF)
    system = HFTokenizer(chatml, system_prompt="Be brief.")
    text = system.decode(system.encode_prompt(QUESTION), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    own = [{"role": "system", "content": "Show your work."}, *USER]
    assert system.encode_prompt(own) == plain.encode_prompt(own)  # a prompt's own system message wins


def test_special_ids_and_stop_ids(chatml):
    tok, auto = HFTokenizer(chatml), transformers.AutoTokenizer.from_pretrained(str(chatml))
    im_end, endoftext = auto.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (im_end, endoftext, None) == (2, 0, None)
    assert tok.stop_ids == [im_end, endoftext]
    assert tok.vocab_size == len(auto) == 402  # trained vocabulary + <think>, </think>
    completion = tok.encode(" He has 28.", add_bos=False)
    assert tok.encode(" He has 28.") == completion  # no BOS in a ChatML tokenizer
    assert tok.decode(completion + [im_end]) == " He has 28."


def test_no_double_bos_with_a_template_that_writes_it(tmp_path):
    path = write_tokenizer(tmp_path, bos_token="<|begin_of_text|>")
    tok, auto = HFTokenizer(path), transformers.AutoTokenizer.from_pretrained(str(path))
    assert tok.bos_id == 3 and auto.encode("hi")[0] == 3  # its post-processor adds BOS to plain text
    ids = tok.encode_prompt(QUESTION)
    assert ids[:2] == [3, 1] and ids.count(3) == 1  # <|begin_of_text|><|im_start|>, once
    assert HFTokenizer(path, chat_template=False).encode_prompt(QUESTION) == auto.encode(QUESTION)


def test_without_chat_template_and_bad_paths(chatml, tmp_path):
    tok = HFTokenizer(chatml, chat_template=False)
    assert tok.encode_prompt(QUESTION) == transformers.AutoTokenizer.from_pretrained(str(chatml)).encode(QUESTION)
    with pytest.raises(ValueError, match="a prompt is a list of chat messages, but chat templates are off"):
        tok.encode_prompt(USER)
    with pytest.raises(ValueError, match="tokenizer.system_prompt needs a chat template"):
        HFTokenizer(chatml, chat_template=False, system_prompt="Be brief.")
    with pytest.raises(TokenizerLoadError, match=r"empty is not a Hugging Face tokenizer directory: it "
                                                 r"needs tokenizer.json or tokenizer_config.json"):
        HFTokenizer(tmp_path / "empty")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_a_truncated_file_is_named(chatml, tmp_path, name):
    """transformers' own error names no file (`Expecting value: line 615 column 4`)."""
    broken = tmp_path / "broken"
    shutil.copytree(chatml, broken)
    (broken / name).write_bytes((broken / name).read_bytes()[:-20])
    with pytest.raises(TokenizerLoadError, match=rf"broken/{re.escape(name)} is not valid JSON \(.*line \d+ column "
                                                 rf"\d+.*\): it is truncated or corrupt"):
        HFTokenizer(broken)


def test_save_pretrained_round_trip(chatml, tmp_path):
    tok = HFTokenizer(chatml, chat_template_kwargs={"enable_thinking": False})
    saved = tok.save_pretrained(tmp_path / "export")
    again = HFTokenizer(saved, chat_template_kwargs={"enable_thinking": False})
    assert again.encode_prompt(QUESTION) == tok.encode_prompt(QUESTION)
    assert again.stop_ids == [tok.eos_id]  # generation_config.json belongs to the model export


def test_chat_rows_and_overlong_prompts_in_tokens(chatml, tmp_path):
    tok = HFTokenizer(chatml)
    rows = [{"prompt": [{"role": "user", "content": QUESTION}], "answer": 28},
            {"prompt": QUESTION * 5, "answer": "140"}, {"prompt": "Hi?", "answer": "0"}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    limit = len(tok.encode_prompt(QUESTION))  # the chat template counts
    with pytest.warns(UserWarning, match="dropped 1 of 3 rows"):
        prompts = FilePrompts(path, max_prompt_length=limit, tokenizer=tok)
    assert [ex.answer for ex in prompts] == ["28", "0"] and prompts.dropped_overlong == 1
    assert tok.encode_prompt(prompts.examples[0].prompt) == tok.encode_prompt(QUESTION)
