"""The 8-GPU Hugging Face recipes: refused until the user names the checkpoint and the data, then valid as written."""
import pytest
from omegaconf import OmegaConf

from spectrain.config import ConfigError, load_config
from spectrain.config.loading import resolve_recipe

RECIPES = ("qwen3_gsm8k", "llama3_math")
REQUIRED = ("data.train_files", "data.val_files", "policy.path")


def required_set(tmp_path) -> list[str]:
    """The `???` keys pointed at paths that do not exist: loading must not read them."""
    return [f"{key}={tmp_path / 'absent' / key}" for key in REQUIRED]


def recipe_leaves(name: str) -> dict:
    """Every value the recipe file sets, by dotted key (`???` left out)."""
    node = OmegaConf.load(resolve_recipe(name))
    leaves = {}

    def walk(sub, prefix):
        for key in sub:
            if OmegaConf.is_missing(sub, key):
                continue
            value = sub[key]
            if OmegaConf.is_dict(value):
                walk(value, f"{prefix}{key}.")
            else:
                leaves[prefix + str(key)] = value
    walk(node, "")
    return leaves


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_lists_every_missing_path(name):
    with pytest.raises(ConfigError, match="required values are missing") as err:
        load_config(name)
    assert str(list(REQUIRED)) in str(err.value)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_loads_once_paths_are_set_without_reading_them(name, tmp_path):
    config = load_config(name, required_set(tmp_path))
    assert config.policy.path == str(tmp_path / "absent" / "policy.path")
    assert (config.task.name, config.reward.name) == ("files", "math_verify")
    assert (config.policy.dtype, config.trainer.accelerator, config.parallel.dp) == ("bfloat16", "cuda", 8)
    assert config.sft.enabled is False and config.draft.draft_vocab_size == 32000


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_value_reaches_the_config(name, tmp_path):
    """No key is dropped or coerced on the way: the recipe's numbers are the run's numbers."""
    config = OmegaConf.structured(load_config(name, required_set(tmp_path)))
    leaves = recipe_leaves(name)
    assert len(leaves) > 30
    for key, value in leaves.items():
        assert OmegaConf.select(config, key) == value, key


@pytest.mark.parametrize("name", RECIPES)
def test_longest_allowed_prompt_fits_the_engine(name, tmp_path):
    """A prompt at data.max_prompt_length plus a full answer and the draft's lookahead fits rollout.max_model_len,
    so no file that passes the length filter can fail the length check at start-up."""
    c = load_config(name, required_set(tmp_path))
    need = c.data.max_prompt_length + c.rollout.response_length + c.draft.num_speculative_tokens + 1
    assert c.data.filter_overlong_prompts and need <= c.rollout.max_model_len


@pytest.mark.parametrize("name, step, per_update", [("qwen3_gsm8k", 1024 * 5, 256 * 5), ("llama3_math", 64 * 32, 512)])
def test_batch_sizes_match_the_cited_recipes(name, step, per_update, tmp_path):
    """verl's train_batch_size x n and ppo_mini_batch_size x n; NeMo-RL's prompts x generations and
    train_global_batch_size."""
    c = load_config(name, required_set(tmp_path))
    completions = c.rollout.prompts_per_step * c.rollout.n
    assert (completions, completions // c.grpo.minibatches) == (step, per_update)
