"""A checkpoint's own tokenizer, encoding prompts exactly as vLLM does.

The trainer hands vLLM `prompt_token_ids`, so it has to reproduce vLLM's own chat path:
render the messages with the tokenizer's chat template as text, then encode that text
without adding special tokens (the template writes BOS itself when the model wants one).
Stop ids come from `generation_config.json` as well as the tokenizer: instruct models end a
turn on a token (`<|im_end|>`, `<|eot_id|>`) that is not always the tokenizer's EOS.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from spectrain.tasks.tokenizer import Prompt

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # a tokenizer directory holds one of them
_JSON_FILES = (*TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json")  # what AutoTokenizer parses


class TokenizerLoadError(ValueError):
    """A tokenizer directory that cannot be loaded. The message names the file, not the config key: the caller
    knows whether `tokenizer.path` or `policy.path` gave the directory."""

# Qwen3's ChatML layout, reduced to what prompts need: `enable_thinking=false` pre-fills an
# empty thinking block, as Qwen3's own template does.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)
CHATML_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 (pad, -, eos)


class HFTokenizer:
    """`transformers.AutoTokenizer` from a local directory, behind the `PromptTokenizer` protocol.

    `chat_template=None` uses the tokenizer's chat template when it has one. String prompts
    become one user message (after `system_prompt`, if any); message lists are used as given.
    """

    def __init__(
        self,
        path: str | Path,
        chat_template: bool | None = None,
        chat_template_kwargs: dict | None = None,
        system_prompt: str | None = None,
    ) -> None:
        self._tokenizer = _load(path)
        has_template = self._tokenizer.chat_template is not None
        if chat_template and not has_template:
            raise ValueError(f"tokenizer.chat_template: true, but the tokenizer in {path} has no chat template; "
                             f"set tokenizer.chat_template to null or false, or use a tokenizer with one")
        self.uses_chat_template = has_template if chat_template is None else chat_template
        if not self.uses_chat_template and (system_prompt is not None or chat_template_kwargs):
            key = "tokenizer.system_prompt" if system_prompt is not None else "tokenizer.chat_template_kwargs"
            raise ValueError(f"{key} needs a chat template, but the chat template of {path} is "
                             f"{'off' if has_template else 'missing'}; remove {key} or turn tokenizer.chat_template on")
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.system_prompt = system_prompt
        self.stop_ids = _stop_ids(path, self._tokenizer.eos_token_id)
        self.eos_id = self.stop_ids[0]
        self.bos_id = self._tokenizer.bos_token_id
        pad = self._tokenizer.pad_token_id
        self.pad_id = self.eos_id if pad is None else pad

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added tokens included."""
        return len(self._tokenizer)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """The ids vLLM computes for this prompt: chat-templated when chatting, else its plain encoding."""
        if not self.uses_chat_template:
            if not isinstance(prompt, str):
                raise ValueError("tokenizer.chat_template: a prompt is a list of chat messages, but chat templates "
                                 "are off or the tokenizer has none; give string prompts or a tokenizer with one")
            return self.encode(prompt)
        text = self._tokenizer.apply_chat_template(self.messages(prompt), add_generation_prompt=True,
                                                   tokenize=False, **self.chat_template_kwargs)
        return self._tokenizer.encode(text, add_special_tokens=False)

    def messages(self, prompt: Prompt) -> list[dict]:
        """The conversation a prompt stands for, with the system prompt first unless it has its own."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if self.system_prompt is not None and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """`add_bos` adds the tokenizer's own special tokens (BOS for Llama, nothing for Qwen)."""
        return self._tokenizer.encode(text, add_special_tokens=add_bos)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save_pretrained(self, directory: str | Path) -> Path:
        self._tokenizer.save_pretrained(str(directory))
        return Path(directory)


def _load(path: str | Path):
    from transformers import AutoTokenizer

    directory = Path(path)
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise TokenizerLoadError(f"{path} is not a Hugging Face tokenizer directory: it needs "
                                 f"{' or '.join(TOKENIZER_FILES)}")
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # transformers and tokenizers raise anything from OSError to a bare Exception
        raise TokenizerLoadError(_load_failure(directory, exc)) from exc


def _load_failure(directory: Path, exc: Exception) -> str:
    """Which file is broken when one of the JSON files is (transformers' own error names none), else its reason."""
    for file in (directory / name for name in _JSON_FILES):
        try:
            json.loads(file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            return f"{file} is not valid JSON ({err}): it is truncated or corrupt"
        except OSError:  # absent (most are optional) or unreadable: the loader's reason below says which
            continue
    reason = next(iter(str(exc).strip().splitlines()), "")
    return f"cannot load the tokenizer in {directory} ({type(exc).__name__}: {reason})"


def _stop_ids(path: str | Path, eos_id: int | None) -> list[int]:
    """The tokenizer's EOS first, then `generation_config.json`'s `eos_token_id` (an int or a list)."""
    config = Path(path) / "generation_config.json"
    try:
        generation_eos = json.loads(config.read_text()).get("eos_token_id") if config.is_file() else None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TokenizerLoadError(f"{config} is not valid JSON ({err}): it is truncated or corrupt") from err
    except OSError as err:
        raise TokenizerLoadError(f"cannot read {config} ({err.strerror or err})") from err
    if isinstance(generation_eos, int):
        generation_eos = [generation_eos]
    stops = list(dict.fromkeys(([] if eos_id is None else [eos_id]) + list(generation_eos or [])))
    if not stops:
        raise TokenizerLoadError(f"the tokenizer in {path} has no eos_token and there is no eos_token_id in its "
                                 f"generation_config.json; set eos_token in tokenizer_config.json")
    return stops


def build_chatml_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path,
                               bos_token: str | None = None):
    """Train a byte-level BPE tokenizer on `texts` and save it with a Qwen-style ChatML template.

    Returns the `transformers.PreTrainedTokenizerFast` that `AutoTokenizer.from_pretrained(out_dir)`
    loads again. Ids 0-2 are `<|endoftext|>` (pad), `<|im_start|>` and `<|im_end|>` (EOS, the end
    of a turn); `<think>` and `</think>` are added tokens. `bos_token` makes it Llama-like: the
    post-processor prepends it to plain encodings and the template starts with it. Writes no
    `generation_config.json`: that belongs to the model saved next to it.
    """
    from transformers import PreTrainedTokenizerFast

    special = list(CHATML_SPECIAL_TOKENS) + ([bos_token] if bos_token else [])
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    template = CHATML_TEMPLATE
    if bos_token:
        bos_id = tokenizer.token_to_id(bos_token)
        tokenizer.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos_token} $A", pair=f"{bos_token} $A $B",
                                          special_tokens=[(bos_token, bos_id)])])
        template = "{{- bos_token -}}" + template
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                      bos_token=bos_token, chat_template=template,
                                      clean_up_tokenization_spaces=False)
    wrapped.add_tokens(["<think>", "</think>"])
    wrapped.save_pretrained(str(out_dir))
    return wrapped
