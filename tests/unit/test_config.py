"""Recipe loading: inheritance, overrides, and every error path names the key and the fix."""
import pytest

from spectrain.config import ConfigError, load_config, to_yaml
from spectrain.errors import InputWarning


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_default_recipe_loads():
    cfg = load_config()
    assert cfg.rollout.group_size >= 2 and cfg.draft.mode == "cotrained"


def test_defaults_inheritance_and_overrides(tmp_path):
    write(tmp_path, "base.yaml", "rollout:\n  group_size: 4\n  max_new_tokens: 10\n")
    child = write(tmp_path, "child.yaml", "defaults: [base]\nrollout:\n  max_new_tokens: 12\n")
    cfg = load_config(child, ["trainer.max_steps=3", "draft.mode=frozen"])
    assert (cfg.rollout.group_size, cfg.rollout.max_new_tokens) == (4, 12)
    assert cfg.trainer.max_steps == 3 and cfg.draft.mode == "frozen"


def test_packaged_parent_by_name(tmp_path):
    child = write(tmp_path, "c.yaml", "defaults: [tiny_cpu]\ntrainer:\n  max_steps: 2\n")
    assert load_config(child).trainer.max_steps == 2


@pytest.mark.parametrize("overrides, needle", [
    (["rollout.group_sise=4"], "rollout.group_sise"),
    (["rollout.group_size=four"], "rollout.group_size"),
    (["rollout.group_size=1"], "rollout.group_size"),
    (["rollout.max_model_len=4096"], "policy.max_position_embeddings"),
    (["draft.mode=sometimes"], "draft.mode"),
    (["parallel.pp=9"], "parallel.pp"),
    (["parallel.pp_schedule=ZeroBubble"], "parallel.pp_schedule"),
    (["draft.tap_layers=[0,1,7]"], "draft.tap_layers"),
    (["task.name=files"], "data.train_files"),
    (["task.name=jsonl"], "task.name: 'jsonl' is now 'files'"),
    (["data.train_files=x.jsonl"], "task.name"),
    (["task.path=x.jsonl"], "'task.path' was renamed to 'data.train_files'"),
    (["speculation.long_tail.max_steps=2"],
     "'speculation.long_tail.max_steps' was renamed to 'speculation.long_tail.max_updates'"),
    (["speculation.long_tail.max_updates=-1"], "speculation.long_tail.max_updates: is -1"),
    (["reward.name=custom"], "reward.path"),
    (["reward.name=nope"], "reward.name"),
    (["draft.init=path"], "draft.path"),
    (["policy.dtype=float16"], "policy.dtype"),
    (["trainer.accelerator=tpu"], "trainer.accelerator"),
    (["data.prompt_template=no placeholder"], "data.prompt_template"),
    (["trainer.max_steps"], "key=value"),
    (["grpo.kl_beta=0.1", "parallel.cp=2"], "grpo.kl_beta"),
    (["grpo.minibatches=0"], "grpo.minibatches"),
    (["rollout.prompts_per_step=2", "rollout.group_size=2", "grpo.minibatches=5"], "grpo.minibatches"),
    (["grpo.epochs=0"], "grpo.epochs"),
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


@pytest.mark.parametrize("key, value, needle", [
    ("draft.aux_layer_ids", "[1,2,3]", r"'draft\.aux_layer_ids' was renamed to 'draft\.tap_layers'"),
    ("draft.ttt_steps", "2", r"'draft\.ttt_steps' was renamed to 'draft\.ttt_passes'"),
    ("sft.eval_prompts", "64", r"'sft\.eval_prompts' was removed: .*rollout\.eval_prompts"),
])
def test_renamed_and_removed_keys_say_what_to_use(tmp_path, key, value, needle):
    section, _, name = key.partition(".")
    recipe = write(tmp_path, "old.yaml", f"defaults: [tiny_cpu]\n{section}:\n  {name}: {value}\n")
    with pytest.raises(ConfigError, match=needle):
        load_config(recipe)
    with pytest.raises(ConfigError, match=f"command-line override: {needle}"):
        load_config(None, [f"{key}={value}"])


def test_renamed_and_removed_keys_do_not_invalidate_what_an_older_spectrain_recorded():
    from spectrain.config.loading import upgrade_recorded_keys
    from spectrain.train.warm_start import draft_cache_key

    key = draft_cache_key(load_config())
    draft = key["draft"]
    recorded = {**key, "sft": {**key["sft"], "eval_prompts": 128},  # a draft warm-up cached before the renames
                "draft": {"ttt_steps": draft["ttt_passes"], "aux_layer_ids": draft["tap_layers"],
                          "warmup_lr": draft["warmup_lr"], "pass_decay": draft["pass_decay"],
                          "warmup_steps": draft["warmup_steps"],
                          **{k: draft[k] for k in ("init", "path", "draft_vocab_size")}}}
    assert upgrade_recorded_keys(recorded) == key


def test_moved_task_keys_are_read_in_their_new_sections():
    from spectrain.config.loading import upgrade_recorded_keys

    recorded = {"task": {"name": "jsonl", "path": "p.jsonl", "reward": "exact_answer", "partial_credit": 0.5}}
    assert upgrade_recorded_keys(recorded) == {"task": {"name": "files"}, "data": {"train_files": "p.jsonl"},
                                               "reward": {"name": "exact_answer", "partial_credit": 0.5}}


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
    ("trainer.save_top_k=2 trainer.eval_every_n_steps=0", r"trainer\.save_top_k: ranks checkpoints by the held-out"),
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
