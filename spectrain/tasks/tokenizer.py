"""What the trainer needs of a tokenizer, and the character tokenizer of the embedded recipe.

No tokenizer hub is reachable, so the default recipe builds its own. It is a real
`tokenizers.Tokenizer` saved in the Hugging Face layout, so vLLM (which loads tokenizers
through `transformers.AutoTokenizer`) and the trainer produce the same ids. A checkpoint's
own tokenizer is `spectrain.tasks.hf_tokenizer.HFTokenizer`; both are `PromptTokenizer`s.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Protocol

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import WordLevel

from spectrain.errors import ConfigError

# A prompt: text, or chat messages ({"role", "content"}) that a chat template renders.
Prompt = str | list[dict] | tuple[dict, ...]

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0..3, in this order
CHARSET = (
    string.digits
    + "+-*= \n"
    + string.ascii_lowercase
    + string.ascii_uppercase
    + ".,:;?!()'\"/"
)


def build_char_tokenizer() -> Tokenizer:
    """One token per character; `<bos>` is prepended like Llama so vLLM prompts match SFT."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(CHARSET))}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=UNK))
    # `[\s\S]` rather than `.` so newlines are split into their own token too.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # join characters back without separators
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    return tokenizer


def save_tokenizer(directory: str | Path) -> Path:
    """Write the files `transformers.AutoTokenizer.from_pretrained(directory)` needs."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_char_tokenizer().save(str(directory / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        # transformers would otherwise "clean up" e.g. " ," into "," and break round trips.
        "clean_up_tokenization_spaces": False,
        **special,
    }
    _write_json(directory / "tokenizer_config.json", config)
    _write_json(directory / "special_tokens_map.json", special)
    return directory


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


class PromptTokenizer(Protocol):
    """The trainer's view of a tokenizer; its ids must equal the ones vLLM computes for the same prompt."""

    pad_id: int
    eos_id: int  # ends SFT targets
    stop_ids: list[int]  # every id that ends a completion (eos first)

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int | None:
        """None for tokenizers without BOS (Qwen)."""
        ...

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """The `prompt_token_ids` vLLM gets: chat template and special tokens included."""
        ...

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Plain text; completions use `add_bos=False`."""
        ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def save_pretrained(self, directory: str | Path) -> Path: ...


class CharTokenizer:
    """Thin wrapper used by the trainer; ids equal `AutoTokenizer` ids for the same text."""

    def __init__(self) -> None:
        self._tokenizer = build_char_tokenizer()
        vocab = self._tokenizer.get_vocab()
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = (vocab[t] for t in SPECIAL_TOKENS)
        self.stop_ids = [self.eos_id]
        self._known = frozenset(CHARSET)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """`add_bos=True` matches what vLLM feeds the model for a string prompt."""
        return self._tokenizer.encode(text, add_special_tokens=add_bos).ids

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """A text prompt as vLLM encodes a string prompt (with `<bos>`); there is no chat template."""
        if not isinstance(prompt, str):
            raise ConfigError(
                "tokenizer.path: a prompt is a list of chat messages, but the character tokenizer has no chat "
                "template; set policy.path (or tokenizer.path) to a checkpoint whose tokenizer has one, or give "
                "string prompts"
            )
        return self.encode(prompt)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save_pretrained(self, directory: str | Path) -> Path:
        """HF-style name, so `hf_io.save_pretrained(model, dir, tokenizer=...)` can call it."""
        return save_tokenizer(directory)

    def unknown_chars(self, text: str) -> list[str]:
        """Characters of `text` that would become `<unk>`, sorted, so callers can reject them."""
        return sorted(set(text) - self._known)
