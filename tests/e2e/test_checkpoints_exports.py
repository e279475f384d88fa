"""`trainer.keep_checkpoints` and `trainer.export_every_n_steps` through `spectrain fit`, a resume, and vLLM loading
an export: the newest step checkpoints and exports stay, a resume goes on counting, `spectrain eval` scores them,
and an export serves rollouts with its draft."""
import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from spectrain.cli import main as cli_main
from spectrain.rollout.engine import SamplingConfig
from spectrain.rollout.vllm.engine import VLLMRolloutEngine
from spectrain.tasks.tokenizer import CharTokenizer
from spectrain.train.trainer import SpecTrainer
from tests.helpers import TINY, metrics

pytestmark = pytest.mark.slow
KEEP = ["trainer.keep_checkpoints=2", "trainer.export_every_n_steps=1", "trainer.keep_exports=2",
        "eval.every_n_steps=0", "trainer.log_samples_every_n_steps=0"]


def fit(run, steps: int) -> None:
    assert cli_main(["fit", "tiny_cpu", f"trainer.run_dir={run}", *TINY, *KEEP, f"trainer.max_steps={steps}"]) == 0


def names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_step_checkpoints_and_exports_are_kept_resumed_and_served_by_vllm(tmp_path):
    run = tmp_path / "run"
    fit(run, 3)
    assert names(run / "checkpoints") == ["last.ckpt", "step_000002.ckpt", "step_000003.ckpt"]
    assert names(run / "exports") == ["step_000002", "step_000003"]
    assert torch.load(run / "checkpoints" / "step_000002.ckpt", weights_only=False)["global_step"] == 2

    fit(run, 4)  # resumes from last.ckpt (step 3): the count and the pruning go on
    assert names(run / "checkpoints") == ["last.ckpt", "step_000003.ckpt", "step_000004.ckpt"]
    assert names(run / "exports") == ["step_000003", "step_000004"]
    assert json.loads((run / "spectrain_run.json").read_text())["result"]["steps"] == 4
    # the last step's export holds the weights final/ holds
    for part, weights in (("policy", "model.safetensors"), ("draft", "model.safetensors")):
        exported, final = (load_file(d / part / weights) for d in (run / "exports" / "step_000004", run / "final"))
        assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)

    # `spectrain eval` of the run scores final/ as the run's own final evaluation did (same prompts, greedy)
    out = tmp_path / "eval.json"
    assert cli_main(["eval", str(run), "--samples", "4", "--out", str(out)]) == 0
    scores = json.loads(out.read_text())
    final = json.loads((run / "spectrain_run.json").read_text())["result"]["final"]
    assert scores["policy"] == str(run / "final" / "policy") and scores["prompts"] == 8 and scores["samples"] == 4
    assert scores["greedy_reward"] == pytest.approx(final["greedy_reward"], abs=1e-6)
    passes = [scores[f"sampled_pass@{k}"] for k in (1, 2, 4)]
    assert all(0 <= p <= 1 for p in [*passes, scores["greedy_pass@1"], scores["sampled_reward"]])
    assert passes == sorted(passes) and scores["mean_acceptance_length"] >= 1
    # an export directory evaluates on its own
    assert cli_main(["eval", str(run / "exports" / "step_000003"), "--samples", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["policy"] == str(run / "exports" / "step_000003" / "policy")

    export = run / "exports" / "step_000003"
    engine = VLLMRolloutEngine(export / "policy", export / "draft", num_speculative_tokens=3, max_model_len=128,
                               kv_cache_gib=1)  # what the fits above set VLLM_CPU_KVCACHE_SPACE to
    try:
        tok = CharTokenizer()
        prompts = [tok.encode_prompt(p) for p in ("12+34=", "50+7=", "3+3=", "81+9=")]
        completions = engine.generate(prompts, SamplingConfig(n=1, max_tokens=8, temperature=0.0))
        assert len(completions) == 4 and all(c.token_ids for c in completions)
        assert engine.spec_decode_counters().num_drafts > 0  # the exported draft proposed tokens
    finally:
        engine.shutdown()


def test_save_top_k_keeps_the_best_held_out_checkpoints_across_a_resume(tmp_path):
    run = tmp_path / "run"
    top_k = ["trainer.save_top_k=2", "eval.every_n_steps=1", "trainer.log_samples_every_n_steps=0"]
    for steps in (3, 5):  # the second fit resumes from step 3
        assert cli_main(["fit", "tiny_cpu", f"trainer.run_dir={run}", *TINY, *top_k, f"trainer.max_steps={steps}"]) == 0
        scores = {int(r["step"]): float(r["eval/greedy_reward"]) for r in metrics(run) if r.get("eval/greedy_reward")}
        assert sorted(scores) == list(range(1, steps + 1))  # every step, once each
        best = sorted(scores, key=lambda s: (scores[s], s), reverse=True)[:2]
        expected = sorted(f"step_{s:06d}-greedy_reward={scores[s]:.4f}.ckpt" for s in best)
        assert names(run / "checkpoints" / "best") == expected  # no candidate left over
        for s in best:
            ckpt = torch.load(run / "checkpoints" / "best" / f"step_{s:06d}-greedy_reward={scores[s]:.4f}.ckpt",
                              weights_only=False)
            assert ckpt["global_step"] == s


def test_a_signal_during_the_final_export_leaves_no_half_final_and_the_same_command_writes_it(tmp_path, monkeypatch,
                                                                                              capsys):
    """Ctrl-C while final/ is written (the policy done, the draft not yet): no final/ at all, `spectrain eval` says
    the export was interrupted and what to run, and the same command (a resume at the last step) writes final/."""
    run = tmp_path / "run"
    argv = ["fit", "tiny_cpu", f"trainer.run_dir={run}", *TINY, "trainer.max_steps=1", "eval.every_n_steps=0",
            "trainer.log_samples_every_n_steps=0"]
    export_draft = SpecTrainer.export_draft

    def interrupted(policy, draft, out_dir):
        if out_dir.name.startswith("final"):
            os.kill(os.getpid(), signal.SIGINT)  # lands here, in the final export
        return export_draft(policy, draft, out_dir)

    monkeypatch.setattr(SpecTrainer, "export_draft", staticmethod(interrupted))
    assert cli_main(argv) == 130
    assert "stopped by SIGINT during the final sync, evaluation and export" in capsys.readouterr().err
    assert (run / "final.partial" / "policy" / "model.safetensors").is_file() and not (run / "final").exists()
    assert cli_main(["eval", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the final export of" in err[0] and "was interrupted" in err[0], err
    assert "run the run's `spectrain fit` command again" in err[0], err

    monkeypatch.undo()
    assert cli_main(argv) == 0  # resumes checkpoints/last.ckpt at its last step: the final evaluation and export again
    assert not (run / "final.partial").exists()
    for part in ("policy/model.safetensors", "policy/tokenizer.json", "draft/config.json", "draft/model.safetensors"):
        assert (run / "final" / part).is_file(), part
