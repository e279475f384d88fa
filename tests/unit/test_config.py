"""Recipe loading: inheritance, overrides, and every error path names the key and the fix."""
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from spectrain.config import ConfigError, load_config, to_yaml
from spectrain.errors import InputWarning

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_default_recipe_loads():
    cfg = load_config()
    assert cfg.rollout.n >= 2 and cfg.draft.mode == "cotrained"


def test_defaults_inheritance_and_overrides(tmp_path):
    write(tmp_path, "base.yaml", "rollout:\n  n: 4\n  response_length: 10\n")
    child = write(tmp_path, "child.yaml", "defaults: [base]\nrollout:\n  response_length: 12\n")
    cfg = load_config(child, ["trainer.max_steps=3", "draft.mode=frozen"])
    assert (cfg.rollout.n, cfg.rollout.response_length) == (4, 12)
    assert cfg.trainer.max_steps == 3 and cfg.draft.mode == "frozen"


def test_packaged_parent_by_name(tmp_path):
    child = write(tmp_path, "c.yaml", "defaults: [tiny_cpu]\ntrainer:\n  max_steps: 2\n")
    assert load_config(child).trainer.max_steps == 2


@pytest.mark.parametrize("overrides, needle", [
    (["rollout.group_sise=4"], "rollout.group_sise"),
    (["rollout.n=four"], "rollout.n"),
    (["rollout.n=1"], "rollout.n"),
    (["rollout.max_model_len=4096"], "toy.max_position_embeddings"),
    (["draft.mode=sometimes"], "draft.mode"),
    (["parallel.pp=9"], "parallel.pp"),
    (["parallel.pp_schedule=ZeroBubble"], "parallel.pp_schedule"),
    (["draft.tap_layers=[0,1,7]"], "draft.tap_layers"),
    (["task.name=files"], "data.train_files"),
    (["task.name=jsonl"], "task.name: 'jsonl' is not one of ['arithmetic', 'files']"),
    (["data.train_files=x.jsonl"], "task.name"),
    (["speculation.long_tail.max_updates=-1"], "speculation.long_tail.max_updates: is -1"),
    (["reward.name=custom"], "reward.path"),
    (["reward.name=nope"], "reward.name"),
    (["draft.init=path"], "draft.path"),
    (["policy.dtype=float16"], "policy.dtype"),
    (["trainer.accelerator=tpu"], "trainer.accelerator"),
    (["data.prompt_template=no placeholder"], "data.prompt_template"),
    (["trainer.max_steps"], "key=value"),
    (["grpo.kl_loss_coef=0.1", "parallel.cp=2"], "grpo.kl_loss_coef"),
    (["grpo.minibatches=0"], "grpo.minibatches"),
    (["rollout.prompts_per_step=2", "rollout.n=2", "grpo.minibatches=5"], "grpo.minibatches"),
    (["grpo.ppo_epochs=0"], "grpo.ppo_epochs"),
])
def test_bad_values_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("[", r"\[")):
        load_config(None, overrides)


def test_missing_recipe_lists_packaged():
    with pytest.raises(ConfigError, match="tiny_cpu"):
        load_config("no_such_recipe")


def test_malformed_yaml(tmp_path):
    bad = write(tmp_path, "bad.yaml", "rollout: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_not_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "list.yaml", "- a\n- b\n"))


def test_required_value_marker(tmp_path):
    path = write(tmp_path, "req.yaml", "task:\n  name: files\ndata:\n  train_files: ???\n")
    with pytest.raises(ConfigError, match=r"missing.*data\.train_files"):
        load_config(path)
    assert load_config(path, ["data.train_files=/tmp/x.jsonl"]).data.train_files == "/tmp/x.jsonl"


@pytest.mark.parametrize("override, fixed", [
    ("rollout.vllm_kwargs={max_num_seqs:8}", "rollout.vllm_kwargs={max_num_seqs: 8}"),
    ("rollout.vllm_kwargs={max_num_seqs: 8, num_gpu_blocks_override:10}",
     "rollout.vllm_kwargs={max_num_seqs: 8, num_gpu_blocks_override: 10}"),
    ("tokenizer.chat_template_kwargs={enable_thinking:false}",
     "tokenizer.chat_template_kwargs={enable_thinking: false}"),
    ("trainer.callbacks=[{target:my_pkg.Cb, args: {}}]", "trainer.callbacks=[{target: my_pkg.Cb, args: {}}]"),
])
def test_a_mapping_override_without_a_space_after_the_colon_shows_the_fix(override, fixed):
    """YAML reads `{a:1}` as the key 'a:1' with no value: refused, with the override as it should be written."""
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value).endswith(f"(a mapping needs a space after ':'); write '{fixed}'")
    assert load_config(None, [fixed])  # the fix loads


def test_inheritance_loop(tmp_path):
    write(tmp_path, "a.yaml", "defaults: [b]\n")
    write(tmp_path, "b.yaml", "defaults: [a]\n")
    with pytest.raises(ConfigError, match="loops"):
        load_config(str(tmp_path / "a.yaml"))


RENAMES = [("rollout.group_size", "rollout.n", "4"), ("rollout.max_new_tokens", "rollout.response_length", "16"),
           ("grpo.kl_beta", "grpo.kl_loss_coef", "0.1"), ("grpo.kl_estimator", "grpo.kl_loss_type", "k1"),
           ("grpo.clip_eps", "grpo.clip_ratio", "0.2"), ("grpo.clip_eps_low", "grpo.clip_ratio_low", "0.2"),
           ("grpo.clip_eps_high", "grpo.clip_ratio_high", "0.28"),
           ("grpo.norm_adv_by_std", "grpo.norm_adv_by_std_in_grpo", "false"), ("grpo.epochs", "grpo.ppo_epochs", "2"),
           ("trainer.eval_every_n_steps", "eval.every_n_steps", "5"), ("rollout.eval_prompts", "eval.prompts", "8"),
           ("rollout.eval_samples", "eval.samples", "4"), ("draft.check_alive", "sync.check_alive", "false"),
           ("draft.on_dead", "sync.on_dead", "disable"), ("draft.collapse_ratio", "sync.collapse_ratio", "0.4"),
           ("task.digits", "toy.digits", "3"), ("task.operands", "toy.operands", "3"),
           ("policy.hidden_size", "toy.hidden_size", "64"), ("policy.num_hidden_layers", "toy.num_hidden_layers", "4")]


@pytest.mark.parametrize("old, new, value", RENAMES)
def test_an_old_key_is_refused_in_one_line_naming_the_new_one(tmp_path, old, new, value):
    """No migration: the old name is refused (recipe or override), the message names the new key, and the new key
    loads."""
    section, _, name = old.partition(".")
    recipe = write(tmp_path, "old.yaml", f"defaults: [tiny_cpu]\n{section}:\n  {name}: {value}\n")
    needle = rf"'{re.escape(old)}' is spectrain's old name for '{re.escape(new)}'.*: use {re.escape(new)}$"
    for args in ((recipe, []), (None, [f"{old}={value}"])):
        with pytest.raises(ConfigError, match=needle) as info:
            load_config(*args)
        assert "\n" not in str(info.value)
    load_config(None, [f"{new}={value}"])


def glossary_keys() -> list[tuple[str, str, str]]:
    """(framework, its key, spectrain's key) for every verl and NeMo-RL key docs/glossary.md's key tables name."""
    from spectrain.config.schema import SpecTrainConfig

    schema = OmegaConf.structured(SpecTrainConfig)
    rows, columns = [], None
    for line in (ROOT / "docs" / "glossary.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if cells[:3] == ["spectrain", "verl", "NeMo-RL"]:
            columns = cells
            continue
        if not cells or columns is None or set(cells[0]) <= {"-"} or not cells[0].startswith("`"):
            columns = columns if cells else None
            continue
        ours = re.split(r"[=\s]", re.findall(r"`([^`]+)`", cells[0])[0])[0]
        for framework, cell in (("verl", cells[1]), ("NeMo-RL", cells[2])):
            previous = None
            for token in re.findall(r"`([^`]+)`", cell):
                key = re.split(r"[=:\s(]", token)[0]
                if key.startswith(".") and previous:  # `custom_reward_function.path` / `.name`
                    key = previous.rsplit(".", 1)[0] + key
                elif "." not in key and previous:  # `loss_fn.ratio_clip_min` / `ratio_clip_max`
                    key = f"{previous.rsplit('.', 1)[0]}.{key}"
                if "." not in key:
                    continue
                previous = key
                if OmegaConf.select(schema, key, default="?absent") == "?absent":  # the same key in both: not one
                    rows.append((framework, key, ours))
    return rows


def test_the_glossary_maps_the_other_frameworks_keys():
    keys = {key for _, key, _ in glossary_keys()}
    assert {"actor_rollout_ref.rollout.n", "data.train_batch_size", "grpo.num_generations_per_prompt",
            "policy.train_global_batch_size", "actor_rollout_ref.actor.kl_loss_coef",
            "algorithm.norm_adv_by_std_in_grpo", "trainer.test_freq", "grpo.val_period"} <= keys


@pytest.mark.parametrize("framework, key, ours", glossary_keys())
def test_a_verl_or_nemo_rl_key_is_refused_in_one_line_naming_spectrains(tmp_path, framework, key, ours):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{key}=1"])
    message = str(info.value)
    assert "\n" not in message and f"'{key}' is {framework}'s key; spectrain's is '{ours}'" in message, message
    *sections, name = key.split(".")
    recipe = "defaults: [tiny_cpu]\n" + "".join(f"{'  ' * i}{s}:\n" for i, s in enumerate(sections))
    with pytest.raises(ConfigError, match=f"^recipe .*'{re.escape(key)}' is {framework}'s key"):
        load_config(write(tmp_path, "theirs.yaml", recipe + f"{'  ' * len(sections)}{name}: 1\n"))


@pytest.mark.parametrize("override, needle", [
    ("algorithm.kl_ctrl.kl_coef=0.001",
     "'algorithm.kl_ctrl.kl_coef' is verl's key; spectrain's is 'grpo.kl_loss_coef'"),
    ("actor_rollout_ref.rollout.val_kwargs.n=1", "spectrain's is 'eval.samples'"),
    ("actor_rollout_ref.hybrid_engine=true", "'actor_rollout_ref.hybrid_engine' is a verl key spectrain has no"),
    ("loss_fn.use_importance_sampling_correction=true", "is a NeMo-RL key spectrain has no"),
])
def test_other_keys_under_verl_and_nemo_rl_sections_are_refused_as_theirs(override, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, [override])


def test_the_reward_literal_names_every_registered_reward():
    import typing

    from spectrain.config.schema import RewardName
    from spectrain.tasks.rewards import REWARD_FNS

    assert set(typing.get_args(RewardName)) == set(REWARD_FNS)


@pytest.mark.parametrize("key", ["policy.dtype", "policy.attention_backend", "task.name", "data.on_bad_row",
                                 "reward.name",
                                 "rollout.engine", "rollout.engine_ranks", "rollout.dtype", "grpo.loss_agg_mode",
                                 "grpo.kl_loss_type", "grpo.lr_scheduler", "draft.mode", "draft.init",
                                 "draft.loss_kernel", "parallel.pp_schedule", "speculation.mode",
                                 "trainer.accelerator", "trainer.resume", "trainer.save_top_k_metric",
                                 "trainer.save_top_k_mode", "sync.on_mismatch", "sync.on_dead"])
def test_an_enumerated_key_is_a_literal_refused_in_one_line_with_the_allowed_values(key):
    """Each enumerated key is typed `Literal[...]` in schema.py: omegaconf refuses another value at load time (one
    line: key, value, allowed values), and `validate` refuses it in a config built in Python, in the same words."""
    import dataclasses
    import typing

    from spectrain.config import schema
    from spectrain.config.validation import validate

    section, _, name = key.partition(".")
    section_type = {f.name: f.type for f in dataclasses.fields(schema.SpecTrainConfig)}[section]
    hints = typing.get_type_hints(getattr(schema, section_type) if isinstance(section_type, str) else section_type)
    allowed = typing.get_args(hints[name])
    assert typing.get_origin(hints[name]) is typing.Literal and allowed
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{key}=bogus"])
    assert str(info.value) == f"{key}: 'bogus' is not one of {list(allowed)}"
    config = load_config()
    setattr(getattr(config, section), name, "bogus")
    needle = rf"^{re.escape(key)}: 'bogus' is not one of {re.escape(str(list(allowed)))}$"
    with pytest.raises(ConfigError, match=needle):
        validate(config)


def test_a_run_directory_in_another_layout_is_refused_in_one_line(tmp_path):
    from spectrain.errors import RunDirError
    from spectrain.train.run_dir import RunDir

    config = load_config(None, [f"trainer.run_dir={tmp_path / 'run'}"])
    run = RunDir(tmp_path / "run", config)
    (tmp_path / "run").mkdir()
    old = OmegaConf.to_container(OmegaConf.structured(config))
    old["rollout"]["group_size"] = old["rollout"].pop("n")
    (tmp_path / "run" / "config.yaml").write_text(OmegaConf.to_yaml(old))
    with pytest.raises(RunDirError, match=r"another config layout .*only there: rollout\.group_size; only here: "
                                          r"rollout\.n\).*another trainer\.run_dir\.$") as info:
        run._check_same_config()
    assert "\n" not in str(info.value)


def test_a_warm_start_cache_in_another_layout_is_refused_in_one_line(tmp_path):
    import json

    from spectrain.errors import RunDirError
    from spectrain.train.warm_start import CACHE_META, cached, policy_cache_key

    key = policy_cache_key(load_config())
    old = {**key, "task": {**key["task"], "digits": 2, "operands": 2}}  # before the toy section
    del old["toy"]
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / CACHE_META).write_text(json.dumps({"settings": old}))
    with pytest.raises(RunDirError, match=r"keyed in another layout .*task\.digits, task\.operands\)") as info:
        cached(tmp_path / "cache", key, "warm-start policy")
    assert "\n" not in str(info.value)
    (tmp_path / "cache" / CACHE_META).write_text(json.dumps({"settings": key}))
    assert cached(tmp_path / "cache", key, "warm-start policy")


def test_paths_expand_home_and_variables(tmp_path, monkeypatch):
    """`~`, `$NAME` and `${NAME}` in every path key, from the command line or a recipe; interpolations still resolve."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPECTRAIN_TEST_DATA", str(tmp_path / "data"))
    assert load_config(None, ["policy.path=~/ckpt"]).policy.path == str(tmp_path / "home" / "ckpt")
    assert load_config(None, ["policy.path=$HOME/ckpt"]).policy.path == str(tmp_path / "home" / "ckpt")
    assert load_config(None, ["tokenizer.path=${SPECTRAIN_TEST_DATA}/tok"]).tokenizer.path == str(tmp_path / "data/tok")
    recipe = write(tmp_path, "r.yaml", "defaults: [tiny_cpu]\ntask: {name: files}\n"
                                       "data:\n  train_files: ['${SPECTRAIN_TEST_DATA}/a.jsonl', ~/b.jsonl]\n"
                                       "  val_files: $SPECTRAIN_TEST_DATA/v.jsonl\n"
                                       "trainer:\n  run_dir: ~/runs/r\n  warmstart_dir: ${trainer.run_dir}/cache\n")
    config = load_config(recipe)
    assert config.data.train_files == [str(tmp_path / "data/a.jsonl"), str(tmp_path / "home/b.jsonl")]
    assert config.data.val_files == str(tmp_path / "data/v.jsonl")
    assert (config.trainer.run_dir, config.trainer.warmstart_dir) == (str(tmp_path / "home/runs/r"),
                                                                      str(tmp_path / "home/runs/r/cache"))
    assert f"run_dir: {tmp_path}/home/runs/r" in to_yaml(config)  # what show-config prints


def test_null_paths_still_mean_the_default():
    config = load_config(None, ["policy.path=null", "tokenizer.path=null", "data.val_files=null"])
    assert (config.policy.path, config.tokenizer.path, config.data.val_files) == (None, None, None)


def input_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, InputWarning)]


@pytest.mark.parametrize("overrides, needle", [
    (["task.name=files", "data.train_files=[a.jsonl, b.jsonl]", "data.val_files=./b.jsonl"],
     r"\[spectrain\] data\.val_files: \./b\.jsonl is also in data\.train_files: the held-out curve is measured on "
     r"training prompts"),
    (["data.filter_overlong_prompts=false"],
     r"\[spectrain\] data\.filter_overlong_prompts=false does nothing without data\.max_prompt_length"),
    (["rollout.engine=torch"], r"\[spectrain\] draft\.mode=cotrained with rollout\.engine=torch: the torch engine "
                               r"never speculates, so the draft never drafts, though it is still trained; set "
                               r"draft\.mode=none, or rollout\.engine=vllm"),
    (["rollout.engine=torch", "draft.mode=frozen"], r"draft\.mode=frozen with rollout\.engine=torch"),
    (["grpo.lr_warmup_steps=100", "trainer.max_steps=60"],
     r"\[spectrain\] grpo\.lr_warmup_steps=100 is not shorter than the run \(trainer\.max_steps=60\): the policy's lr "
     r"ramps from 0 at step 1 and reaches only 59% of grpo\.lr=3e-05 by the last step; set grpo\.lr_warmup_steps "
     r"below trainer\.max_steps \(e\.g\. 6, or 0 for none\), or raise trainer\.max_steps$"),
    (["grpo.lr_warmup_steps=1", "trainer.max_steps=1", "grpo.lr_scheduler=cosine"],
     r"the policy's lr stays at 0 for the whole run, and grpo\.lr_scheduler=cosine never decays; set "
     r"grpo\.lr_warmup_steps below trainer\.max_steps \(e\.g\. 0: no warm-up\)"),
])
def test_accepted_values_that_do_nothing_are_warned_about(overrides, needle):
    with pytest.warns(InputWarning, match=needle):
        load_config(None, overrides)


@pytest.mark.parametrize("overrides", [
    [],
    ["task.name=files", "data.train_files=a.jsonl", "data.val_files=b.jsonl"],
    ["data.filter_overlong_prompts=false", "data.max_prompt_length=64"],
    ["rollout.engine=torch", "draft.mode=none"],
    ["grpo.lr_warmup_steps=59", "trainer.max_steps=60", "grpo.lr_scheduler=cosine"],
])
def test_their_fixes_are_not_warned_about(overrides, recwarn):
    load_config(None, overrides)
    assert input_warnings(recwarn) == []


@pytest.mark.parametrize("override, message", [
    ("trainer.keep_checkpoints=-2", r"trainer\.keep_checkpoints: is -2; give how many step checkpoints to keep: 0 "
                                    r"\(only last\.ckpt\), N, or -1 \(all\)"),
    ("trainer.export_every_n_steps=-1", r"trainer\.export_every_n_steps: is -1; give N >= 1 to export every N steps"),
    ("trainer.keep_exports=0", r"trainer\.keep_exports: is 0; give how many exports to keep: N >= 1, or -1 \(all\)"),
    ("trainer.save_top_k=-1", r"trainer\.save_top_k: is -1; give how many best checkpoints to keep"),
    ("trainer.save_top_k=2 trainer.save_top_k_metric=reward", r"trainer\.save_top_k_metric: .*eval/greedy_reward"),
    ("trainer.save_top_k=2 trainer.save_top_k_mode=best", r"trainer\.save_top_k_mode: .*max"),
    ("trainer.save_top_k=2 eval.every_n_steps=0", r"trainer\.save_top_k: ranks checkpoints by the held-out"),
])
def test_checkpoint_and_export_keys_are_checked(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny_cpu", override.split())


@pytest.mark.parametrize("override, message", [
    ("speculation.measure_speedup_every_n_steps=-1", r"speculation\.measure_speedup_every_n_steps: is -1; .*>= 0"),
    ("speculation.measure_speedup_every_n_steps=5 draft.mode=none",
     r"speculation\.measure_speedup_every_n_steps: compares decoding with and without the draft, but draft\.mode=none"),
    ("speculation.measure_speedup_prompts=0", r"speculation\.measure_speedup_prompts: is 0; .*>= 1"),
    ("speculation.measure_speedup_every_n_steps=5 speculation.measure_speedup_prompts=17",
     r"speculation\.measure_speedup_prompts: is 17; the sample comes from "
                                               r"the step's rollout\.prompts_per_step=16 prompts: give at most that"),
])
def test_speedup_probe_keys_are_checked(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny_cpu", override.split())


def test_the_probe_sample_size_is_only_checked_when_the_probe_is_on():
    assert load_config("tiny_cpu", ["rollout.prompts_per_step=2"]).speculation.measure_speedup_prompts == 4
