"""The math_verify and custom rewards: math answers in the forms models write, user functions that misbehave."""

import threading
import time
import warnings

import pytest
import torch

from spectrain.tasks.rewards import CustomReward, RewardError, get_reward_fn, reward_name, score


@pytest.mark.parametrize(
    "completion,answer,reward",
    [
        ("Natalia sold 48 clips in April and 24 in May, 48+24 = 72.\n#### 72", "72", 1.0),
        ("So the total is \\boxed{72} clips.", "72", 1.0),
        ("First 3 then 5 apples. The answer is 72", "72", 1.0),
        ("The answer is $\\frac{1}{2}$", "0.5", 1.0),
        ("#### 0.5", "\\frac{1}{2}", 1.0),
        ("#### 1/2", "0.5", 1.0),
        ("\\boxed{x^2 + 1}", "1 + x^2", 1.0),  # bare LaTeX references parse too
        ("so $2^{1/2}$", "\\sqrt{2}", 1.0),
        ("#### 73", "72", 0.0),
        ("She has 3 + 4 = 7.\n#### 7", "Ada has 3 + 4 = 7 apples.\n#### 7", 1.0),  # a GSM8K worked reference
        ("She has 3 + 4 = 7.\n#### 4", "Ada has 3 + 4 = 7 apples.\n#### 7", 0.0),
        ("I do not know.", "72", 0.0),
        ("", "72", 0.0),
    ],
)
def test_math_verify(completion, answer, reward):
    assert get_reward_fn("math_verify")(completion, answer) == reward


def test_math_verify_off_the_main_thread():
    """math_verify's own timeouts use signal.alarm, which raises on any other thread."""
    fn, scores = get_reward_fn("math_verify"), []
    worker = threading.Thread(target=lambda: scores.extend([fn("\\boxed{72}", "72"), fn("#### 7", "72")]))
    worker.start()
    worker.join()
    assert scores == [1.0, 0.0]


REWARD_FILE = '''
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "spectrain" and extra_info is None
    return {"score": 0.25 + 0.75 * (solution_str.strip() == ground_truth), "acc": 1}

def plain(completion, answer):
    return len(completion) - len(answer)

def fails(completion, answer):
    return int(completion)

def says_yes(completion, answer):
    return "yes"

def hangs(completion, answer):
    time.sleep(30)
    return 1.0
'''


@pytest.fixture
def reward_py(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    return path


def test_custom_verl_style_and_plain(reward_py):
    verl = get_reward_fn("custom", path=str(reward_py))
    assert (verl(" 72 ", "72"), verl("71", "72")) == (1.0, 0.25)
    assert get_reward_fn("custom", path=reward_py, function="plain")("abcde", "ab") == 3.0


def test_custom_reward_that_raises_shows_the_sample(reward_py):
    fn = get_reward_fn("custom", path=reward_py, function="fails")
    with pytest.raises(RewardError, match=r"'fails' .* raised ValueError: .*\non completion 'x{200}\.\.\. "
                                          r"\(500 chars\)' with answer '72'") as info:
        fn("x" * 500, "72")
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(RewardError, match=r"returned 'yes' on completion '1' .*return a float"):
        get_reward_fn("custom", path=reward_py, function="says_yes")("1", "2")


def test_custom_reward_that_hangs_scores_zero_then_fails(reward_py):
    fn = get_reward_fn("custom", path=reward_py, function="hangs", timeout_s=0.2)
    start = time.monotonic()
    with pytest.warns(UserWarning, match=r"ran past reward.timeout_s=0.2 on completion 'a'.*1 timeouts so far"):
        assert fn("a", "1") == 0.0
    assert time.monotonic() - start < 1.0 and fn.timeouts == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(CustomReward.MAX_CONSECUTIVE_TIMEOUTS - 2):
            fn("b", "1")
    with pytest.raises(RewardError, match=f"on {CustomReward.MAX_CONSECUTIVE_TIMEOUTS} samples in a row"):
        fn("c", "1")


def test_custom_reward_bad_path_function_and_options(tmp_path, reward_py):
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ValueError, match=r"reward.path: .*broken\.py does not import: ModuleNotFoundError"):
        get_reward_fn("custom", path=broken)
    with pytest.raises(ValueError, match=r"reward.path: .*missing\.py is not a file"):
        get_reward_fn("custom", path=tmp_path / "missing.py")
    with pytest.raises(ValueError, match="reward.path: reward.name=custom needs reward.path"):
        get_reward_fn("custom", path=None)
    with pytest.raises(ValueError, match=r"reward.function: .* no function 'score'; it defines: compute_score, "
                                         r"fails, hangs, plain, says_yes"):
        get_reward_fn("custom", path=reward_py, function="score")
    with pytest.raises(ValueError, match="reward.timeout_s must be > 0"):
        get_reward_fn("custom", path=reward_py, timeout_s=0)
    with pytest.raises(ValueError, match="bad options"):
        get_reward_fn("math_verify", partial_credit=0.5)


NON_FINITE_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(ground_truth) if solution_str == "odd one" else 1.0}
'''


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e300"])  # 1e300 is inf in the float32 rewards
def test_a_non_finite_reward_stops_the_step_with_the_sample(tmp_path, value):
    path = tmp_path / "my_reward.py"
    path.write_text(NON_FINITE_FILE)
    fn, name = get_reward_fn("custom", path=path), reward_name("custom", path, "compute_score")
    samples = [(0, "a", value), (0, "b", value), (1, "c", value), (1, "odd one", value)]
    with pytest.raises(RewardError) as info:
        score(fn, samples, name, "the step-3 rollout")
    assert str(info.value) == (
        f"reward.function 'compute_score' in {path} returned {float(value)!r} in the step-3 rollout on prompt 1, "
        f"sample 1: completion 'odd one' with answer '{value}'; a reward must be a finite float32 (a NaN or inf turns "
        f"its group's advantages and then the policy into NaN): fix the function to return a finite score for every "
        f"completion")


def test_finite_rewards_are_scored_in_order():
    rewards = score(lambda completion, answer: len(completion) - float(answer), [(0, "abc", "1"), (1, "", "-2.5")],
                    reward_name("exact_answer"), "the step-1 rollout")
    assert rewards.dtype == torch.float32 and rewards.tolist() == [2.0, 2.5]
    with pytest.raises(RewardError, match=r"^reward\.name=exact_answer returned None in the step-1 rollout on prompt "
                                          r"0, sample 0: completion 'x' with answer 'y'; return a float$"):
        score(lambda completion, answer: None, [(0, "x", "y")], reward_name("exact_answer"), "the step-1 rollout")


def test_a_batched_reward_sees_the_prompts_and_must_return_one_float_per_sample():
    from spectrain.tasks.rewards import RewardInput, reward_inputs, score_batch

    samples = reward_inputs([(0, "a", "1"), (0, "b", "1"), (1, "c", "2")], prompts=["1+0=", "1+1="])
    assert samples[1] == RewardInput("1+0=", "b", "1", prompt_index=0, sample_index=1)
    assert samples[2].prompt == "1+1=" and samples[2].sample_index == 0
    rewards = score_batch(lambda batch: [len(s.prompt) + s.sample_index for s in batch], samples, "MyTrainer.rewards",
                          "the step-1 rollout")
    assert rewards.tolist() == [4.0, 5.0, 4.0]
    with pytest.raises(RewardError, match=r"^MyTrainer\.rewards returned 2 rewards in the step-1 rollout for 3 "
                                          r"samples; return one float per sample, in their order$"):
        score_batch(lambda batch: [1.0, 1.0], samples, "MyTrainer.rewards", "the step-1 rollout")
    with pytest.raises(RewardError, match=r"^MyTrainer\.rewards returned 1\.0 in the step-1 rollout for 3 samples"):
        score_batch(lambda batch: 1.0, samples, "MyTrainer.rewards", "the step-1 rollout")
    with pytest.raises(RewardError, match=r"returned nan in the step-1 rollout on prompt 1, sample 0: completion 'c'"):
        score_batch(lambda batch: [0.0, 0.0, float("nan")], samples, "MyTrainer.rewards", "the step-1 rollout")


def test_errors_name_the_overridden_reward_hook():
    from spectrain.config import load_config
    from spectrain.train.trainer import SpecTrainer

    class Batched(SpecTrainer):
        def rewards(self, samples):
            return [0.0] * len(samples)

    class PerSample(SpecTrainer):
        def reward(self, completion, answer):
            return 0.0

    config = load_config("tiny_cpu", [])
    assert SpecTrainer(config).reward_hook_name() is None
    assert Batched(config).reward_hook_name() == "Batched.rewards"
    assert PerSample(config).reward_hook_name() == "PerSample.reward"
    assert PerSample(config).rewards(reward_inputs_for_test()) == [0.0]


def reward_inputs_for_test():
    from spectrain.tasks.rewards import reward_inputs

    return reward_inputs([(0, "x", "y")])
