"""`GRPOModule`: one GRPO step per batch of prompts, with manual optimization.

`training_step` is the whole step, phase by phase (`spectrain.train.step.PHASES`): the rollout
(`rollout.n` samples per prompt on the live engines), the rewards, the group advantages, the policy
updates (`grpo.minibatches` x `grpo.ppo_epochs` clipped updates, each in micro-batches of at most
`grpo.micro_batch_tokens` tokens, whose first-epoch forwards hand the draft's taps to the draft
updater), the draft update, and the weight sync. Each phase is one call, timed, and its result goes
into the step's `StepResult`. The draft update and the weight sync are callbacks' (`DraftUpdater`,
`WeightSyncer`: `DraftCoTraining` and `WeightSync` by default), called at those points of the step.
The draft and all of its state are `self.draft`, an `OnlineDraft`.
"""
from __future__ import annotations

import contextlib
import copy
import math
import zlib
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from spectrain.batch import RolloutBatch, build_rollout_batch
from spectrain.config import SpecTrainConfig
from spectrain.config.schema import uses_step_loop
from spectrain.errors import NonFiniteError, SpecTrainError
from spectrain.models.eagle3 import Eagle3Draft
from spectrain.models.llama import LlamaForCausalLM, apply_activation_checkpointing
from spectrain.parallel.plan import DraftInputs, LocalPlan, TrainPlan, ttt_valid_tokens
from spectrain.rollout.engine import Completion, LoadStats, RolloutEngine, Sampling, SamplingConfig, SpecDecodeCounters
from spectrain.rollout.engine_layout import EngineLayout, EngineRollout, merge, seeded_configs
from spectrain.rollout.speculation.long_tail import LongTailPolicy, LongTailTrainer
from spectrain.rollout.speculation.stepwise import StepwiseRollouts
from spectrain.rollout.step_loop import EngineLockstep
from spectrain.tasks.rewards import reward_inputs, reward_name, score_batch
from spectrain.train.draft_update import DraftUpdate, warn_if_skipped
from spectrain.train.grpo import group_advantages, grpo_loss, lr_lambda, minibatch_documents, overlong_penalty
from spectrain.train.online_draft import DraftTraining, OnlineDraft
from spectrain.train.step import (
    DraftReport,
    PolicyReport,
    RolloutStats,
    StepCallbacks,
    StepResult,
    SyncReport,
    bind_step_callbacks,
    timed,
)

if TYPE_CHECKING:
    from spectrain.rollout.vllm.engine import VLLMRolloutEngine


def sampling_config(config: SpecTrainConfig, tokenizer, n: int, greedy: bool = False) -> SamplingConfig:
    """`n` samples per prompt with the rollout's settings (greedy: temperature 0), for training, the held-out
    evaluation and `spectrain eval` alike."""
    r = config.rollout
    # no seed here: `GRPOModule.rollout` seeds each prompt's request (`seeded_configs`)
    # the engine stops at the model's EOS by itself; a chat model's other stop ids (e.g. end of turn) ride along
    stops = tuple(i for i in tokenizer.stop_ids if i != tokenizer.eos_id)
    return SamplingConfig(n=n, max_tokens=r.response_length, temperature=0.0 if greedy else r.temperature,
                          top_p=r.top_p, stop_token_ids=stops)


class GRPOModule(L.LightningModule):
    """One GRPO step per batch of prompts (`training_step`). `draft` is the EAGLE-3 draft model (or None), which
    the module hands to its owner (`OnlineDraft`, with `draft_optimizer_state`: the offline warm-up's AdamW state
    to continue from). `reward_fn` scores a rollout in one call: `(list[RewardInput]) -> one float per sample`
    (`spectrain.tasks.rewards.per_sample` wraps a `(completion, answer) -> float`)."""

    def __init__(self, config: SpecTrainConfig, policy: LlamaForCausalLM, draft: Eagle3Draft | None,
                 tokenizer, reward_fn, reward: str | None = None, engine: RolloutEngine | None = None,
                 draft_optimizer_state: dict | None = None) -> None:
        super().__init__()
        self.config = config
        apply_activation_checkpointing(policy, config.policy.activation_checkpointing)
        policy.logprob_chunk_tokens = config.policy.logprob_chunk_tokens
        self.policy = policy
        self.draft = (OnlineDraft(draft, DraftTraining.from_config(config.draft), draft_optimizer_state)
                      if draft is not None else None)
        # the draft's weights are checkpointed, moved and sharded with the policy's (Lightning's state_dict);
        # everything else of the draft is its owner's
        self.draft_model = draft
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        r = config.reward  # how errors name the reward: the configured one, or `reward` (a subclass's hook)
        self.reward_name = reward or reward_name(r.name, r.path, r.function)
        self.automatic_optimization = False
        # KL(policy || warm start) needs the warm start frozen beside the policy
        # (in grpo.reference_dtype: bfloat16 halves it, as verl's and NeMo-RL's bf16 reference)
        self.reference = (copy.deepcopy(policy).requires_grad_(False).to(getattr(torch, config.grpo.reference_dtype))
                          if config.grpo.kl_loss_coef > 0 else None)
        self.engine = engine  # this rank's engine (None on a rank without one); not checkpointed
        self.engines = EngineLayout.single()  # which ranks serve which prompts (SpecTrainer sets it)
        self.plan: TrainPlan = LocalPlan()  # replaced by SpecParallelStrategy under dp/cp/pp
        self.step_callbacks = StepCallbacks(None, None)  # the draft updater and weight syncer, bound at fit start
        # the step loop, when k adapts per engine step or the long tail trains the draft
        self.stepwise = StepwiseRollouts(config) if uses_step_loop(config) else None
        self._warned_preemption = False

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """The draft's own ids: the ones exported to vLLM, so training and inference see the same taps."""
        assert self.draft is not None, "no draft: no taps"
        return tuple(self.draft.model.cfg.tap_layers)

    @property
    def trains_draft(self) -> bool:
        return self.draft is not None and self.config.draft.mode == "cotrained"

    @override
    def on_fit_start(self) -> None:
        """Bind the callbacks that run the step's draft update and weight sync; build the draft's optimizer over
        its parameters as the strategy left them (sharded under FSDP)."""
        self.step_callbacks = bind_step_callbacks(self.trainer.callbacks)  # type: ignore[attr-defined]  # Lightning's
        if self.draft is not None and self.trains_draft:
            self.draft.setup(self.trainer.strategy.optimizer_state)

    @property
    def schedules_policy_lr(self) -> bool:
        """Whether the policy's lr follows a schedule (`grpo.lr_scheduler`, `grpo.lr_warmup_steps`); the default
        constant lr needs none."""
        g = self.config.grpo
        return g.lr_scheduler != "constant" or g.lr_warmup_steps > 0

    @override
    def configure_optimizers(self):
        """The policy's AdamW and, with `schedules_policy_lr`, its lr schedule, stepped once per GRPO step and
        checkpointed by Lightning (a resume continues it). The draft's optimizer is `DraftCoTraining`'s."""
        g = self.config.grpo
        policy_opt = torch.optim.AdamW(self.policy.parameters(), lr=g.lr, weight_decay=g.weight_decay)
        if not self.schedules_policy_lr:
            return policy_opt
        return [policy_opt], [torch.optim.lr_scheduler.LambdaLR(
            policy_opt, lr_lambda(g.lr_scheduler, g.lr_warmup_steps, self.config.trainer.max_steps))]

    def policy_optimizer(self):
        return self.optimizers()

    def policy_lr_scheduler(self):
        return self.lr_schedulers() if self.schedules_policy_lr else None

    @property
    def teacher_dtype(self) -> torch.dtype:
        """The dtype of the teacher logits and draft loss (the policy's, at least float32)."""
        return torch.promote_types(next(self.policy.parameters()).dtype, torch.float32)

    @override
    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return batch  # prompts are strings: nothing to move, and Lightning rejects frozen dataclasses

    # weight sync (collective under PP: the plan gathers the stages and the draft on rank 0) ----
    def policy_weights_for_sync(self):
        """Full tensors on every rank with an engine (None elsewhere); collective under FSDP and PP."""
        return self.plan.policy_weights(self.policy, everywhere=self.engines.ranks_with_engines > 1)

    def draft_weights_for_sync(self):
        from spectrain.models.eagle3 import draft_sync_weights

        gather = getattr(self.plan, "draft_weights", None)  # plans without it hold the whole draft on every rank
        return (gather(self.draft.model, everywhere=self.engines.ranks_with_engines > 1) if gather is not None
                else draft_sync_weights(self.draft.model))

    # rollout --------------------------------------------------------------------------
    def sampling_config(self, n: int, greedy: bool = False) -> SamplingConfig:
        return sampling_config(self.config, self.tokenizer, n, greedy)

    def rollout(self, examples, n: int, purpose: str,
                greedy: bool = False) -> tuple[list[Completion], torch.Tensor, RolloutStats]:
        """`generate` and `score` in one: the held-out evaluation and the speedup probe (no draft training)."""
        completions, stats = self.generate(examples, n, purpose, greedy)
        where = ("the speedup probe" if purpose == "speedup" else "the held-out evaluation") + \
            f" after step {self.global_step}"
        return completions, self.score(examples, completions, where), stats

    def generate(self, examples, n: int, purpose: str, greedy: bool = False,
                 step: int | None = None) -> tuple[list[Completion], RolloutStats]:
        """Generate `n` samples per prompt, every engine its share of the prompts (`EngineLayout`), and give every
        rank the whole rollout. Each prompt's request is seeded from (seed, `purpose`, step, its global index), so
        the rollout does not depend on how many engines served it.

        `step` (training rollouts only: an evaluation must not change the draft) lets long-tail spot updates train
        the draft during it."""
        share = self.engines.prompt_range(len(examples))
        local = None
        if self.engines.has_engine and not share:  # more engines than prompts (a small held-out set)
            local = EngineRollout([], SpecDecodeCounters(), LoadStats(), 0.0)
        elif self.engines.has_engine:
            assert self.engine is not None, "no rollout engine attached: use SpecTrainer, or set module.engine"
            prompts = [self.tokenizer.encode_prompt(examples[i].prompt) for i in share]
            sampling = seeded_configs(self.sampling_config(n, greedy), share, self.config.trainer.seed, purpose,
                                      self.global_step)
            before = self.engine.spec_decode_counters()
            self.engine.take_load_stats()  # from here on: this rollout's
            seconds: dict[str, float] = {}
            with timed(seconds, "rollout"):
                completions = self.generate_rollout(prompts, sampling, step)
            spec = self.engine.spec_decode_counters() - before
            completions = [replace(c, prompt_index=share[c.prompt_index]) for c in completions]  # global indices
            local = EngineRollout(completions, spec, self.engine.take_load_stats(), seconds["rollout"])
        whole = merge(self.engines.gather(local))
        stats = RolloutStats(whole.seconds, len(whole.completions), sum(len(c.token_ids) for c in whole.completions),
                             whole.spec, whole.load, whole.per_engine_acceptance)
        return whole.completions, stats

    def score(self, examples, completions: list[Completion], where: str) -> torch.Tensor:
        """The rewards of the whole rollout's `completions` ([N] float32) on every rank: each engine's leader
        scores its own share of the prompts (`where` names the rollout in errors)."""
        rewards = None
        if self.engines.is_leader:
            share = self.engines.prompt_range(len(examples))
            mine = [c for c in completions if c.prompt_index in share]
            samples = reward_inputs([(c.prompt_index, self.tokenizer.decode(c.token_ids),
                                      examples[c.prompt_index].answer) for c in mine],
                                    [ex.prompt for ex in examples])
            rewards = score_batch(self.reward_fn, samples, self.reward_name, where).tolist() if mine else []
        return torch.tensor([r for part in self.engines.gather(rewards) for r in part], dtype=torch.float32)

    @torch.no_grad()
    def measure_speedup(self, examples) -> dict[str, float]:
        """Decodes `examples` (`rollout.n` samples each, sampled as in training) twice on the engines: as
        they speculate now and without speculation, in an order that alternates by step (neither always runs second
        on a warmer engine). Both generated-tokens/s (all engines' tokens over the slowest engine's time) and their
        ratio `spec/speedup_estimate`, on every rank."""
        rates = {}
        engine = self.engine if self.engines.has_engine else None
        for plain in ((False, True) if self.global_step % 2 == 0 else (True, False)):
            with engine.without_speculation() if plain and engine is not None else contextlib.nullcontext():
                _, _, stats = self.rollout(examples, self.config.rollout.n, "speedup")
            rates[plain] = stats.tokens_per_second
        return {"spec/speedup_estimate": rates[False] / rates[True], "spec/probe_tokens_per_s": rates[False],
                "spec/probe_plain_tokens_per_s": rates[True]}

    @torch.no_grad()
    def evaluate(self, examples, samples: int) -> dict[str, float]:
        """Mean reward on held-out `examples`: greedy, and `samples` per prompt sampled as in training
        (what GRPO optimises), with the sampled mean's standard error (std / sqrt(n): an upper bound
        on the sampling noise, since the prompts are fixed)."""
        self.seed_sampling("eval")
        _, greedy, _ = self.rollout(examples, 1, "eval_greedy", greedy=True)
        _, sampled, _ = self.rollout(examples, samples, "eval")
        return {"greedy_reward": float(greedy.mean()), "sampled_reward": float(sampled.mean()),
                "sampled_reward_se": float(sampled.std() / sampled.numel() ** 0.5)}

    # adaptive speculation and long-tail spot updates (spectrain/rollout/speculation/) --------------
    def generate_rollout(self, prompts: list[list[int]], sampling: Sampling, step: int | None):
        """`engine.generate`, or the step loop when `k` adapts per step or the long tail trains the draft (in the
        rollout of GRPO step `step`)."""
        assert self.engine is not None, "no rollout engine attached: use SpecTrainer, or set module.engine"
        if self.stepwise is None:
            return self.engine.generate(prompts, sampling)
        lockstep = EngineLockstep(self.engines.is_leader) if self.engines.ranks_with_engines > 1 else None
        return self.stepwise.generate(cast("VLLMRolloutEngine", self.engine), prompts, sampling,
                                      self.long_tail_trainer(step) if step is not None else None, lockstep)

    def long_tail_trainer(self, step: int) -> LongTailTrainer | None:
        """Spot updates of the draft on the previous step's taps; None until there are taps to train on."""
        lt, draft = self.config.speculation.long_tail, self.draft
        if not (lt.enabled and self.trains_draft and draft is not None and draft.tail_taps):
            return None

        def spot_update() -> DraftUpdate:
            update = draft.spot_update(self.manual_backward)
            warn_if_skipped(update, f"a spot update in the step-{step} rollout")
            return update

        return LongTailTrainer(LongTailPolicy(lt.threshold, lt.max_updates), spot_update)

    @override
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """The draft's state (collective under FSDP: every rank dumps a checkpoint) and the step loop's."""
        if self.draft is not None:
            checkpoint["draft"] = self.draft.state_dict()
        state = self.stepwise.state_dict() if self.stepwise is not None else None
        if state:
            checkpoint["speculation_controller"] = state

    @override
    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self.draft is not None:
            if "draft" not in checkpoint:
                raise SpecTrainError("the checkpoint holds no draft state (written by an older spectrain, or by a run "
                                     "without a draft): resume it with the version that wrote it, or start a new "
                                     "run in a new trainer.run_dir")
            self.draft.load_state_dict(checkpoint["draft"])
        if self.stepwise is not None:
            self.stepwise.load_state_dict(checkpoint.get("speculation_controller"))

    def seed_sampling(self, purpose: str) -> None:
        """Re-seed torch's global RNG from (seed, purpose, step) before a rollout.

        The requests carry their own seeds; whatever else draws from the global RNG during a rollout
        (a user's reward, a sampler without a seed) is seeded too, though weight syncs advance it and
        no checkpoint holds it: a resumed run draws exactly what the uninterrupted one did.
        """
        torch.manual_seed(zlib.crc32(f"{self.config.trainer.seed}:{purpose}:{self.global_step}".encode()))

    @override
    def training_step(self, examples: list, batch_idx: int) -> dict:
        """One GRPO step, phase by phase (`PHASES`), each timed: the rollout on the engines (which then sleep, with
        rollout.enable_sleep_mode), its rewards, the group advantages, the policy updates (their first epoch's
        forwards hand the draft's taps to the draft updater), the draft update, and the weight sync."""
        step = self.global_step + 1  # the last policy update advances `global_step`
        seconds: dict[str, float] = {}
        self.seed_sampling("train")
        with timed(seconds, "rollout"):
            completions, rollout = self.generate(examples, self.config.rollout.n, "train", step=step)
            self.end_rollout(rollout)
        with timed(seconds, "rewards"):
            rewards = self.score(examples, completions, f"the step-{step} rollout")
        with timed(seconds, "advantages"):
            batch = self.advantages(completions, rewards, len(examples), step)
        with timed(seconds, "policy_updates"):
            policy = self.policy_updates(batch, step)
        with timed(seconds, "draft_update"):
            draft = self.update_draft(step)
        result = StepResult(step, rollout, rewards, batch, policy, draft)
        with timed(seconds, "weight_sync"):
            sync = self.sync_weights(result)
        result = replace(result, sync=sync, seconds=seconds)
        self.log_step(result, len(examples))
        return {"loss": torch.tensor(policy.loss), "step": result}

    def end_rollout(self, rollout: RolloutStats) -> None:
        """The draft's owner keeps the rollout's acceptance; the engine frees its memory for the updates
        (rollout.enable_sleep_mode; a no-op without it)."""
        if self.draft is not None:
            self.draft.observe(rollout.spec)
        if self.engine is not None:  # None on a rank without an engine
            self.engine.sleep()

    def advantages(self, completions: list[Completion], rewards: torch.Tensor, prompts: int,
                   step: int) -> RolloutBatch:
        """The packed rollout with each completion's group advantage (DAPO's overlong penalty and dynamic sampling
        where configured)."""
        g = self.config.grpo
        assert all(len(c.logprobs) == len(c.token_ids) for c in completions), (
            "the rollout engine must return each sampled token's logprob: they are GRPO's old policy")
        shaped = rewards
        if g.overlong_buffer_len > 0:  # DAPO: the advantages see the penalty; `rewards` (logged) stay the task's
            penalty = overlong_penalty(torch.tensor([len(c.token_ids) for c in completions]),
                                       self.config.rollout.response_length, g.overlong_buffer_len,
                                       g.overlong_penalty_factor)
            shaped = (rewards.double() + penalty).to(rewards.dtype)
            self.log("reward/overlong_penalty", float(penalty.mean()), on_step=True, batch_size=prompts)
        advantages = group_advantages(shaped, self.config.rollout.n, g.adv_eps, g.norm_adv_by_std_in_grpo)
        keep = self.dynamic_sampling(shaped, prompts, step) if g.dynamic_sampling else None
        if keep is not None:
            completions, advantages = [completions[i] for i in keep], advantages[keep]
        return build_rollout_batch(completions, advantages).to(self.device)

    def policy_updates(self, batch: RolloutBatch, step: int) -> PolicyReport:
        """`grpo.minibatches` x `grpo.ppo_epochs` clipped updates of the policy on `batch`; the first epoch's
        forwards feed the draft updater's taps. Then the policy's lr schedule steps, once per GRPO step."""
        g = self.config.grpo
        on_taps = self.tap_handler(batch, step)  # None: the draft does not train this step
        generator = torch.Generator().manual_seed(self.config.trainer.seed * 1_000_003 + self.global_step)
        minibatches = min(g.minibatches, batch.num_docs)  # dynamic sampling may leave fewer documents
        updates = [(epoch, docs) for epoch in range(g.ppo_epochs)
                   for docs in minibatch_documents(batch.num_docs, minibatches, generator)]
        results, stats = [], []
        policy_opt = self.policy_optimizer()
        lr = getattr(policy_opt, "optimizer", policy_opt).param_groups[0]["lr"]  # this step's (moves after the updates)
        for i, (epoch, docs) in enumerate(updates):
            part = batch if len(docs) == batch.num_docs else batch.select(docs)
            # the draft sees every document once, from the first epoch's forwards
            result, update_stats = self.policy_update(part, on_taps if epoch == 0 else None, i, len(updates), step)
            results.append(result)
            stats.append(update_stats)
        first = results[0]  # before any update: the engine served exactly this policy
        mismatch = (first.logprobs - first.batch.rollout_logprobs).abs()[first.batch.response_mask]
        mean = lambda key: torch.stack([s[key] for s in stats]).mean()  # noqa: E731
        # Each rank holds a share of the step's tokens (its dp slice, its cp shard; under pp only the last
        # stage has any). clip_fraction and kl are shares normalised by the global token count and the
        # mismatch sums add up, so the sum over ranks is the step's value on every rank (float64 everywhere:
        # one dtype per collective).
        clip_fraction, kl, diff_sum, diff_count = self.sum_over_ranks(torch.stack([
            mean("clip_fraction").double(), mean("kl").double(), mismatch.double().sum(),
            torch.tensor(mismatch.numel(), dtype=torch.float64, device=mismatch.device)])).tolist()
        scheduler = self.policy_lr_scheduler()
        if scheduler is not None:
            scheduler.step()  # once per GRPO step, after its updates
        return PolicyReport(len(updates), mean("loss").item(), mean("grad_norm").item(), clip_fraction, kl,
                            diff_sum / diff_count if diff_count else float("nan"), lr)

    def update_draft(self, step: int) -> DraftReport | None:
        """The draft updater's update (`DraftCoTraining`), None when the draft does not train this step."""
        updater = self.step_callbacks.draft_updater
        return updater.update_draft(self, step) if self.trains_draft and updater is not None else None

    def sync_weights(self, step: StepResult) -> SyncReport | None:
        """Wake the engines (rollout.enable_sleep_mode), then the weight syncer's verified push (`WeightSync`)."""
        slept = self.engine.wake_up() if self.engine is not None else False
        woke = any(self.engines.gather(slept))
        syncer = self.step_callbacks.weight_syncer
        return syncer.sync_weights(self, step, woke) if syncer is not None else None

    def sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.trainer.strategy.reduce(tensor, reduce_op="sum")

    def max_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.trainer.strategy.reduce(tensor, reduce_op="max")

    def dynamic_sampling(self, rewards: torch.Tensor, prompts: int, step: int) -> list[int] | None:
        """DAPO's dynamic sampling, drop-only (no re-sampling to refill the batch): the completions of the groups
        whose (shaped) rewards are not all equal, None to keep all. A group of equal rewards has zero advantage and
        teaches the policy nothing. When every group is such, the step trains on all of them (zero advantage:
        no policy gradient) with a warning. Validation keeps it to parallel.dp=pp=1 (no per-rank document counts)."""
        n = self.config.rollout.n
        groups = rewards.view(-1, n)
        varied = (groups != groups[:, :1]).any(dim=1)
        self.log("rollout/groups_dropped", float((~varied).sum()), on_step=True, batch_size=prompts)
        if varied.all():
            return None
        if not varied.any():
            rank_zero_warn(f"[spectrain] grpo.dynamic_sampling: every group of the step-{step} rollout "
                           f"got equal rewards, so none has an advantage; the step trains on all of them (no policy "
                           f"gradient). Persistent: the task is too easy or too hard for the policy.")
            return None
        return [i for i in range(rewards.numel()) if bool(varied[i // n])]

    def log_step(self, step: StepResult, prompts: int) -> None:
        self.log_dict({
            "reward": step.rewards.mean(),
            "policy/loss": step.policy.loss,
            "policy/grad_norm": step.policy.grad_norm,
            "policy/clip_fraction": step.policy.clip_fraction,
            "policy/kl": step.policy.kl,
            "policy/engine_logprob_diff": step.policy.engine_logprob_diff,
            "policy/lr": step.policy.lr,
            "rollout/tokens_per_s": step.rollout.tokens_per_second,
            "rollout/seconds": step.rollout.seconds,
            "rollout/mean_response_len": step.batch.num_response_tokens / step.batch.num_docs,
            **{f"time/{phase}": seconds for phase, seconds in step.seconds.items()},
        }, on_step=True, batch_size=prompts)
        self.log("reward_mean", step.rewards.mean(), prog_bar=True, on_step=True, batch_size=prompts, logger=False)
        if self.stepwise is not None:
            self.log_dict(self.stepwise.metrics, on_step=True, batch_size=1)
        self.log_rollout_load(step.rollout.load, step.step)

    def log_rollout_load(self, load: LoadStats, step: int) -> None:
        """Queueing and preemption in the engine; warns once when it preempts (a KV cache too small)."""
        self.log_dict({"rollout/preemptions": float(load.preemptions), "rollout/max_running": float(load.max_running),
                       "rollout/max_waiting": float(load.max_waiting)}, on_step=True, batch_size=1)
        if load.preemptions and not self._warned_preemption:
            self._warned_preemption = True
            rank_zero_warn(
                f"[spectrain] vLLM preempted {load.preemptions} sequences in the step-{step} rollout "
                f"(at most {load.max_running} ran at once, {load.max_waiting} waited): its KV cache does not hold "
                f"rollout.prompts_per_step x rollout.n sequences, so it evicts and recomputes them (slow). "
                f"Raise rollout.kv_cache_gib, or lower rollout.prompts_per_step. Logged per step as "
                f"rollout/preemptions.")

    def tap_handler(self, batch: RolloutBatch, step: int):
        """What the policy forwards hand each micro-batch's taps to: the draft updater, when it trains the draft
        this step (`begin_draft_update`), and the long tail's store; None when neither wants them.

        The draft's loss is normalised over the whole rollout, so each micro-batch's share adds up.
        """
        draft = self.draft
        if draft is None or not self.trains_draft:
            return None
        updater = self.step_callbacks.draft_updater
        trainer = updater if updater is not None and updater.begin_draft_update(self, step) else None
        keep = self.config.speculation.long_tail.enabled
        draft.tail_taps = []
        if trainer is None and not keep:
            return None
        valid = ttt_valid_tokens(batch)

        def on_taps(taps: DraftInputs) -> None:
            taps = replace(taps, num_valid_tokens=valid)
            if trainer is not None:
                trainer.on_draft_taps(self, taps)
            if keep:  # spot updates in the next rollout's long tail train on them (one process: bounded there)
                draft.tail_taps.append(taps)

        return on_taps

    def policy_update(self, part: RolloutBatch, on_taps, index: int, count: int, step: int):
        """Update `index` (of GRPO step `step`'s `count`): one clipped policy-gradient update on `part` of the rollout.

        The plan runs `part` in micro-batches of at most `grpo.micro_batch_tokens` tokens per rank, whose
        gradients accumulate; the loss is normalised by `part`'s token count, so the update is the same as
        one whole-part forward. `on_taps` (first epoch only) gets each micro-batch's taps for the draft.

        Ratios are taken against the engine's logprobs, which equal the trainer's before the first
        update (tests/e2e/test_engine.py), so a single update is the plain on-policy gradient and later
        ones are clipped. Only the last update steps Lightning's optimizer wrapper: `global_step`
        counts GRPO steps (rollouts), not updates. A non-finite loss or gradient norm stops the run
        before the optimizer step (`check_finite_update`).
        """
        g = self.config.grpo
        num_tokens = part.num_response_tokens  # global: every rank holds the whole rollout
        num_seqs = part.num_docs  # global too: the seq-mean loss_agg_modes' normaliser
        shares = {"clip_fraction": torch.tensor(0.0), "kl": torch.tensor(0.0)}  # summed over this rank's chunks

        def loss_fn(logprobs: torch.Tensor, local: RolloutBatch):
            ref = self.reference_logprobs(local) if g.kl_loss_coef > 0 else None
            out = grpo_loss(logprobs, local.rollout_logprobs, local.advantages, local.response_mask, g.clip_ratio,
                            ref_logprobs=ref, kl_loss_coef=g.kl_loss_coef, num_tokens=num_tokens,
                            clip_ratio_low=g.clip_ratio_low, clip_ratio_high=g.clip_ratio_high,
                            kl_loss_type=g.kl_loss_type,
                            loss_agg_mode=g.loss_agg_mode, response_lengths=local.response_lengths,
                            num_seqs=num_seqs)
            shares["clip_fraction"] = shares["clip_fraction"] + out.clip_fraction
            shares["kl"] = shares["kl"] + out.kl
            return out.loss, logprobs

        opt = self.policy_optimizer()
        opt.zero_grad(set_to_none=True)
        capture = self.tap_layers if on_taps is not None else ()
        result = self.plan.policy_forward_backward(self.policy, part, loss_fn, capture, self.manual_backward, on_taps,
                                                   g.micro_batch_tokens,
                                                   self.draft.model.t2d if self.draft is not None and capture else None)
        self.plan.reduce_gradients(self.policy)
        grad_norm = self.plan.clip_grad_norm(self.policy, g.grad_clip)
        self.check_finite_update(float(result.loss), float(grad_norm), index, count, step)
        (opt if index == count - 1 else opt.optimizer).step()
        return result, {"loss": result.loss.float(), "grad_norm": grad_norm.detach().float(), **shares}

    def check_finite_update(self, loss: float, grad_norm: float, index: int, count: int, step: int) -> None:
        """Stop before the optimizer step when the update's loss or gradient norm is NaN/inf: one such step makes
        every weight NaN, which would surface only at the next weight sync.

        Both values are the same on every rank (the plans sum the loss shares over the ranks, and the norm is taken
        after the gradient reduction), so every rank raises the same error and none steps alone.
        """
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return
        bf16 = ", bf16 overflow (policy.dtype=float32)" if self.config.policy.dtype == "bfloat16" else ""
        raise NonFiniteError(
            f"policy update {index + 1} of {count} in step {step}: the loss ({loss:.4g}) or the gradient "
            f"norm ({grad_norm:.4g}) is not finite. Stopped before the optimizer step: no weight was changed by it, "
            f"nothing of this step was synced or checkpointed, and the last checkpoint (if any) is intact. Likely "
            f"causes: a learning rate too high (lower grpo.lr), extreme rewards or advantages (check the reward "
            f"function){bf16}. A resume would repeat this step exactly: fix the cause in a new trainer.run_dir")

    @torch.no_grad()
    def reference_logprobs(self, part: RolloutBatch) -> torch.Tensor:
        """Logprobs of `part`'s targets under the frozen warm-start policy (whole documents: cp=pp=1)."""
        assert self.reference is not None, "no KL reference: grpo.kl_loss_coef is 0"
        return self.reference(part.input_ids, part.position_ids, part.cu_seqlens, compute_logits=False,
                              logprob_targets=part.targets).logprobs
