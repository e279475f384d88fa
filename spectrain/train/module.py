"""`GRPOModule`: one GRPO step per batch of prompts, with manual optimization.

Each `training_step` rolls out `group_size` samples per prompt on the live engine, scores
them, computes group advantages, and makes `grpo.minibatches` x `grpo.epochs` clipped
updates of the policy, each in micro-batches of at most `grpo.micro_batch_tokens` tokens.
The first epoch's micro-batch forwards also capture the draft's taps and hand them at once
to the callbacks that train the draft (`on_draft_taps`: `DraftCoTraining`, which owns the
draft's optimizer, backpropagates each and steps it at the end of the step), and
`WeightSync` pushes both models to the engine afterwards.
"""
from __future__ import annotations

import contextlib
import copy
import math
import time
import zlib
from dataclasses import dataclass, field, replace

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from spectrain.batch import RolloutBatch, build_rollout_batch
from spectrain.callbacks.draft_cotraining import DraftCoTraining, migrate_draft_optimizer
from spectrain.config import SpecTrainConfig
from spectrain.config.schema import uses_step_loop
from spectrain.errors import NonFiniteError
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


@dataclass
class RolloutStats:
    seconds: float
    num_sequences: int
    num_tokens: int
    spec: SpecDecodeCounters  # this rollout's delta of the engines' counters, summed over the engines
    load: LoadStats  # preemptions and peak running/waiting sequences during this rollout
    per_engine_acceptance: list[float] = field(default_factory=list)  # each engine's acceptance length, in order

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class StepResult:
    """What one GRPO step did: what was generated, rewarded, trained and measured. Every callback gets it as
    `outputs["step"]` in `on_train_batch_end`; it is all an observer callback may read (docs/dev/contracts.md).
    The same on every rank."""

    step: int  # the step, counted from 1 (as trainer.max_steps counts)
    rollout: RolloutStats  # generation: seconds, sequences, tokens, spec-decode counters, engine load
    rewards: torch.Tensor  # [N] float32, one per completion
    batch: RolloutBatch  # the packed rollout the updates trained on (advantages included)
    updates: int  # policy optimizer steps taken (grpo.minibatches x grpo.epochs)
    policy_loss: float  # mean over the updates
    grad_norm: float  # mean over the updates, before clipping
    clip_fraction: float
    kl: float
    engine_logprob_diff: float  # mean |trainer - engine| logprob of the rollout's tokens before the first update


def sampling_config(config: SpecTrainConfig, tokenizer, n: int, greedy: bool = False) -> SamplingConfig:
    """`n` samples per prompt with the rollout's settings (greedy: temperature 0), for training, the held-out
    evaluation and `spectrain eval` alike."""
    r = config.rollout
    # no seed here: `GRPOModule.rollout` seeds each prompt's request (`seeded_configs`)
    # the engine stops at the model's EOS by itself; a chat model's other stop ids (e.g. end of turn) ride along
    stops = tuple(i for i in tokenizer.stop_ids if i != tokenizer.eos_id)
    return SamplingConfig(n=n, max_tokens=r.max_new_tokens, temperature=0.0 if greedy else r.temperature,
                          top_p=r.top_p, stop_token_ids=stops)


class GRPOModule(L.LightningModule):
    """One GRPO step per batch of prompts (`training_step`), with the draft's taps for `DraftCoTraining`.
    `reward_fn` scores a rollout in one call: `(list[RewardInput]) -> one float per sample`
    (`spectrain.tasks.rewards.per_sample` wraps a `(completion, answer) -> float`)."""

    def __init__(self, config: SpecTrainConfig, policy: LlamaForCausalLM, draft: torch.nn.Module | None,
                 tokenizer, reward_fn, reward: str | None = None, engine: RolloutEngine | None = None) -> None:
        super().__init__()
        self.config = config
        apply_activation_checkpointing(policy, config.policy.activation_checkpointing)
        policy.logprob_chunk_tokens = config.policy.logprob_chunk_tokens
        self.policy = policy
        self.draft = draft
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        r = config.reward  # how errors name the reward: the configured one, or `reward` (a subclass's hook)
        self.reward_name = reward or reward_name(r.name, r.path, r.function)
        self.automatic_optimization = False
        # KL(policy || warm start) needs the warm start frozen beside the policy
        self.reference = copy.deepcopy(policy).requires_grad_(False) if config.grpo.kl_beta > 0 else None
        self.engine = engine  # this rank's engine (None on a rank without one); not checkpointed
        self.engines = EngineLayout.single()  # which ranks serve which prompts (SpecTrainer sets it)
        self.plan: TrainPlan = LocalPlan()  # replaced by SpecParallelStrategy under dp/cp/pp
        self.tail_taps: list[DraftInputs] = []  # the last step's taps, kept only for long-tail spot updates
        # the step loop, when k adapts per engine step or the long tail trains the draft
        self.stepwise = StepwiseRollouts(config) if uses_step_loop(config) else None
        self._warned_preemption = False

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """The draft's own ids: the ones exported to vLLM, so training and inference see the same taps."""
        return tuple(self.draft.cfg.tap_layers)

    @property
    def trains_draft(self) -> bool:
        return self.draft is not None and self.config.draft.mode == "cotrained"

    @property
    def current_step(self) -> int:
        """The step in flight, counted from 1 as `trainer.max_steps` counts (`global_step` counts finished ones)."""
        return self.global_step + 1

    @property
    def schedules_policy_lr(self) -> bool:
        """Whether the policy's lr follows a schedule (`grpo.lr_scheduler`, `grpo.lr_warmup_steps`); the default
        constant lr adds no scheduler, so its checkpoints are laid out as before the option existed."""
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

    def draft_cotraining(self):
        """The `DraftCoTraining` callback of this run, or None: it owns the draft's optimizer and lr ramp."""
        return next((c for c in self.trainer.callbacks if isinstance(c, DraftCoTraining)), None)

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
        return (gather(self.draft, everywhere=self.engines.ranks_with_engines > 1) if gather is not None
                else draft_sync_weights(self.draft))

    # rollout --------------------------------------------------------------------------
    def sampling_config(self, n: int, greedy: bool = False) -> SamplingConfig:
        return sampling_config(self.config, self.tokenizer, n, greedy)

    def rollout(self, examples, n: int, purpose: str, greedy: bool = False,
                train_in_tail: bool = False) -> tuple[list[Completion], torch.Tensor, RolloutStats]:
        """Generate `n` samples per prompt, every engine its share of the prompts (`EngineLayout`), score them,
        and give every rank the whole rollout. Each prompt's request is seeded from (seed, `purpose`, step, its
        global index), so the rollout does not depend on how many engines served it.

        `train_in_tail` lets long-tail spot steps train the draft during it: training rollouts only
        (an evaluation must not change the draft, and runs without gradients); errors name the rollout by it.
        """
        share = self.engines.prompt_range(len(examples))
        local = None
        if self.engines.has_engine and not share:  # more engines than prompts (a small held-out set)
            local = EngineRollout([], [], SpecDecodeCounters(), LoadStats(), 0.0)
        elif self.engines.has_engine:
            assert self.engine is not None, "no rollout engine attached: use SpecTrainer, or set module.engine"
            prompts = [self.tokenizer.encode_prompt(examples[i].prompt) for i in share]
            sampling = seeded_configs(self.sampling_config(n, greedy), share, self.config.trainer.seed, purpose,
                                      self.global_step)
            before = self.engine.spec_decode_counters()
            self.engine.take_load_stats()  # from here on: this rollout's
            started = time.perf_counter()
            completions = self.generate_rollout(prompts, sampling, train_in_tail)
            seconds = time.perf_counter() - started
            spec = self.engine.spec_decode_counters() - before
            where = (f"the step-{self.current_step} rollout" if train_in_tail
                     else f"the held-out evaluation after step {self.global_step}")
            completions = [replace(c, prompt_index=share[c.prompt_index]) for c in completions]  # global indices
            samples = reward_inputs([(c.prompt_index, self.tokenizer.decode(c.token_ids),
                                      examples[c.prompt_index].answer) for c in completions],
                                    [ex.prompt for ex in examples])
            rewards = score_batch(self.reward_fn, samples, self.reward_name, where)
            local = EngineRollout(completions, rewards.tolist(), spec, self.engine.take_load_stats(), seconds)
        whole = merge(self.engines.gather(local))
        stats = RolloutStats(whole.seconds, len(whole.completions), sum(len(c.token_ids) for c in whole.completions),
                             whole.spec, whole.load, whole.per_engine_acceptance)
        return whole.completions, torch.tensor(whole.rewards, dtype=torch.float32), stats

    @torch.no_grad()
    def measure_speedup(self, examples) -> dict[str, float]:
        """Decodes `examples` (`rollout.group_size` samples each, sampled as in training) twice on the engines: as
        they speculate now and without speculation, in an order that alternates by step (neither always runs second
        on a warmer engine). Both generated-tokens/s (all engines' tokens over the slowest engine's time) and their
        ratio `spec/speedup_estimate`, on every rank."""
        rates = {}
        for plain in ((False, True) if self.global_step % 2 == 0 else (True, False)):
            with self.engine.without_speculation() if plain and self.engines.has_engine else contextlib.nullcontext():
                _, _, stats = self.rollout(examples, self.config.rollout.group_size, "speedup")
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
    def generate_rollout(self, prompts: list[list[int]], sampling: Sampling, train_in_tail: bool):
        """`engine.generate`, or the step loop when `k` adapts per step or the long tail trains the draft."""
        if self.stepwise is None:
            return self.engine.generate(prompts, sampling)
        lockstep = EngineLockstep(self.engines.is_leader) if self.engines.ranks_with_engines > 1 else None
        return self.stepwise.generate(self.engine, prompts, sampling,
                                      self.long_tail_trainer() if train_in_tail else None, lockstep)

    def long_tail_trainer(self) -> LongTailTrainer | None:
        """Spot updates of the draft on the previous step's taps; None until there are taps to train on."""
        lt = self.config.speculation.long_tail
        cotraining = self.draft_cotraining()
        if not (lt.enabled and self.trains_draft and self.tail_taps and cotraining is not None):
            return None
        taps = self.tail_taps

        def spot_update() -> DraftUpdate:
            update = cotraining.spot_update(self, taps)
            warn_if_skipped(update, f"a spot update in the step-{self.current_step} rollout")
            return update

        return LongTailTrainer(LongTailPolicy(lt.threshold, lt.max_updates), spot_update)

    @override
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        state = self.stepwise.state_dict() if self.stepwise is not None else None
        if state:
            checkpoint["speculation_controller"] = state

    @override
    def on_load_checkpoint(self, checkpoint: dict) -> None:
        migrate_draft_optimizer(checkpoint)  # before Lightning restores the optimizers and the callbacks
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
    def training_step(self, examples, batch_idx):
        """rollout -> rewards -> advantages -> for each update, for each micro-batch: forward with taps, policy loss,
        backward, the taps to the draft's hook; then the update's optimizer step. Callbacks then get the
        `StepResult`: `DraftCoTraining` steps the draft, `WeightSync` syncs both models to the engine."""
        g = self.config.grpo
        step_number = self.current_step  # the last update's optimizer step advances `global_step`
        self.seed_sampling("train")
        completions, rewards, rollout = self.rollout(examples, self.config.rollout.group_size, "train",
                                                     train_in_tail=True)
        assert all(len(c.logprobs) == len(c.token_ids) for c in completions), (
            "the rollout engine must return each sampled token's logprob: they are GRPO's old policy")
        if self.engine is not None:  # None on a rank without an engine
            self.engine.sleep()  # rollout.enable_sleep_mode: WeightSync wakes it before the sync
        shaped = rewards
        if g.overlong_buffer_len > 0:  # DAPO: the advantages see the penalty; `rewards` (logged) stay the task's
            penalty = overlong_penalty(torch.tensor([len(c.token_ids) for c in completions]),
                                       self.config.rollout.max_new_tokens, g.overlong_buffer_len,
                                       g.overlong_penalty_factor)
            shaped = (rewards.double() + penalty).to(rewards.dtype)
            self.log("reward/overlong_penalty", float(penalty.mean()), on_step=True, batch_size=len(examples))
        advantages = group_advantages(shaped, self.config.rollout.group_size, g.adv_eps, g.norm_adv_by_std)
        keep = self.dynamic_sampling(shaped, len(examples)) if g.dynamic_sampling else None
        if keep is not None:
            completions, advantages = [completions[i] for i in keep], advantages[keep]
        batch = build_rollout_batch(completions, advantages).to(self.device)
        on_taps = self.tap_handler(batch)  # None: no callback trains the draft this step
        generator = torch.Generator().manual_seed(self.config.trainer.seed * 1_000_003 + self.global_step)
        minibatches = min(g.minibatches, batch.num_docs)  # dynamic sampling may leave fewer documents
        updates = [(epoch, docs) for epoch in range(g.epochs)
                   for docs in minibatch_documents(batch.num_docs, minibatches, generator)]
        results, stats = [], []
        policy_opt = self.policy_optimizer()
        lr = getattr(policy_opt, "optimizer", policy_opt).param_groups[0]["lr"]  # this step's (moves after the updates)
        for i, (epoch, docs) in enumerate(updates):
            part = batch if len(docs) == batch.num_docs else batch.select(docs)
            # the draft sees every document once, from the first epoch's forwards
            result, update_stats = self.policy_update(part, on_taps if epoch == 0 else None, i, len(updates))
            results.append(result)
            stats.append(update_stats)
        first = results[0]  # before any update: the engine served exactly this policy
        mismatch = (first.logprobs - first.batch.rollout_logprobs).abs()[first.batch.response_mask]
        mean = lambda key: torch.stack([s[key] for s in stats]).mean()  # noqa: E731
        # Each rank holds a share of the step's tokens (its dp slice, its cp shard; under pp only the last
        # stage has any). clip_fraction and kl are shares normalised by the global token count and the
        # mismatch sums add up, so the sum over ranks is the step's value on every rank (float64 everywhere:
        # one dtype per collective).
        clip_fraction, kl, diff_sum, diff_count = self.trainer.strategy.reduce(torch.stack([
            mean("clip_fraction").double(), mean("kl").double(), mismatch.double().sum(),
            torch.tensor(mismatch.numel(), dtype=torch.float64, device=mismatch.device)]), reduce_op="sum").tolist()
        step = StepResult(step_number, rollout, rewards, batch, len(updates), mean("loss").item(),
                          mean("grad_norm").item(), clip_fraction, kl,
                          diff_sum / diff_count if diff_count else float("nan"))
        scheduler = self.policy_lr_scheduler()
        if scheduler is not None:
            scheduler.step()  # once per GRPO step, after its updates
        self.log_step(step, len(examples))
        self.log("policy/lr", lr, on_step=True, batch_size=len(examples))
        return {"loss": mean("loss"), "step": step}

    def dynamic_sampling(self, rewards: torch.Tensor, prompts: int) -> list[int] | None:
        """DAPO's dynamic sampling, drop-only (no re-sampling to refill the batch): the completions of the groups
        whose (shaped) rewards are not all equal, None to keep all. A group of equal rewards has zero advantage and
        teaches the policy nothing. When every group is such, the step trains on all of them (zero advantage:
        no policy gradient) with a warning. Validation keeps it to parallel.dp=pp=1 (no per-rank document counts)."""
        n = self.config.rollout.group_size
        groups = rewards.view(-1, n)
        varied = (groups != groups[:, :1]).any(dim=1)
        self.log("rollout/groups_dropped", float((~varied).sum()), on_step=True, batch_size=prompts)
        if varied.all():
            return None
        if not varied.any():
            rank_zero_warn(f"[spectrain] grpo.dynamic_sampling: every group of the step-{self.current_step} rollout "
                           f"got equal rewards, so none has an advantage; the step trains on all of them (no policy "
                           f"gradient). Persistent: the task is too easy or too hard for the policy.")
            return None
        return [i for i in range(rewards.numel()) if bool(varied[i // n])]

    def log_step(self, step: StepResult, prompts: int) -> None:
        self.log_dict({
            "reward": step.rewards.mean(),
            "policy/loss": step.policy_loss,
            "policy/grad_norm": step.grad_norm,
            "policy/clip_fraction": step.clip_fraction,
            "policy/kl": step.kl,
            "policy/engine_logprob_diff": step.engine_logprob_diff,
            "rollout/tokens_per_s": step.rollout.tokens_per_second,
            "rollout/seconds": step.rollout.seconds,
            "rollout/mean_response_len": step.batch.num_response_tokens / step.batch.num_docs,
        }, on_step=True, batch_size=prompts)
        self.log("reward_mean", step.rewards.mean(), prog_bar=True, on_step=True, batch_size=prompts, logger=False)
        if self.stepwise is not None:
            self.log_dict(self.stepwise.metrics, on_step=True, batch_size=1)
        self.log_rollout_load(step.rollout.load)

    def log_rollout_load(self, load: LoadStats) -> None:
        """Queueing and preemption in the engine; warns once when it preempts (a KV cache too small)."""
        self.log_dict({"rollout/preemptions": float(load.preemptions), "rollout/max_running": float(load.max_running),
                       "rollout/max_waiting": float(load.max_waiting)}, on_step=True, batch_size=1)
        if load.preemptions and not self._warned_preemption:
            self._warned_preemption = True
            rank_zero_warn(
                f"[spectrain] vLLM preempted {load.preemptions} sequences in the step-{self.current_step} rollout "
                f"(at most {load.max_running} ran at once, {load.max_waiting} waited): its KV cache does not hold "
                f"rollout.prompts_per_step x rollout.group_size sequences, so it evicts and recomputes them (slow). "
                f"Raise rollout.kv_cache_gib, or lower rollout.prompts_per_step. Logged per step as "
                f"rollout/preemptions.")

    def tap_handler(self, batch: RolloutBatch):
        """What the policy forwards hand each micro-batch's taps to: the callbacks that train the draft this step
        (`on_draft_taps`, e.g. `DraftCoTraining`), and the long tail's store; None when nobody wants them.

        The draft's loss is normalised over the whole rollout, so each micro-batch's share adds up.
        """
        consumers = [c for c in self.trainer.callbacks
                     if callable(getattr(c, "wants_draft_taps", None)) and c.wants_draft_taps(self.trainer)]
        keep = self.config.speculation.long_tail.enabled
        self.tail_taps = []
        if not (self.trains_draft and (consumers or keep)):
            return None
        valid = ttt_valid_tokens(batch)

        def on_taps(taps: DraftInputs) -> None:
            taps = replace(taps, num_valid_tokens=valid)
            for consumer in consumers:
                consumer.on_draft_taps(self.trainer, self, taps)
            if keep:  # spot updates in the next rollout's long tail train on them (one process: bounded there)
                self.tail_taps.append(taps)

        return on_taps

    def policy_update(self, part: RolloutBatch, on_taps, index: int, count: int):
        """Update `index` (of the step's `count`): one clipped policy-gradient update on `part` of the rollout.

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
            ref = self.reference_logprobs(local) if g.kl_beta > 0 else None
            out = grpo_loss(logprobs, local.rollout_logprobs, local.advantages, local.response_mask, g.clip_eps,
                            ref_logprobs=ref, kl_beta=g.kl_beta, num_tokens=num_tokens,
                            clip_eps_low=g.clip_eps_low, clip_eps_high=g.clip_eps_high, kl_estimator=g.kl_estimator,
                            loss_agg_mode=g.loss_agg_mode, response_lengths=local.response_lengths,
                            num_seqs=num_seqs)
            shares["clip_fraction"] = shares["clip_fraction"] + out.clip_fraction
            shares["kl"] = shares["kl"] + out.kl
            return out.loss, logprobs

        opt = self.policy_optimizer()
        opt.zero_grad(set_to_none=True)
        capture = self.tap_layers if on_taps is not None else ()
        result = self.plan.policy_forward_backward(self.policy, part, loss_fn, capture, self.manual_backward, on_taps,
                                                   g.micro_batch_tokens, self.draft.t2d if capture else None)
        self.plan.reduce_gradients(self.policy)
        grad_norm = self.plan.clip_grad_norm(self.policy, g.grad_clip)
        self.check_finite_update(float(result.loss), float(grad_norm), index, count)
        (opt if index == count - 1 else opt.optimizer).step()
        return result, {"loss": result.loss.float(), "grad_norm": grad_norm.detach().float(), **shares}

    def check_finite_update(self, loss: float, grad_norm: float, index: int, count: int) -> None:
        """Stop before the optimizer step when the update's loss or gradient norm is NaN/inf: one such step makes
        every weight NaN, which would surface only at the next weight sync.

        Both values are the same on every rank (the plans sum the loss shares over the ranks, and the norm is taken
        after the gradient reduction), so every rank raises the same error and none steps alone.
        """
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return
        bf16 = ", bf16 overflow (policy.dtype=float32)" if self.config.policy.dtype == "bfloat16" else ""
        raise NonFiniteError(
            f"policy update {index + 1} of {count} in step {self.current_step}: the loss ({loss:.4g}) or the gradient "
            f"norm ({grad_norm:.4g}) is not finite. Stopped before the optimizer step: no weight was changed by it, "
            f"nothing of this step was synced or checkpointed, and the last checkpoint (if any) is intact. Likely "
            f"causes: a learning rate too high (lower grpo.lr), extreme rewards or advantages (check the reward "
            f"function){bf16}. A resume would repeat this step exactly: fix the cause in a new trainer.run_dir")

    @torch.no_grad()
    def reference_logprobs(self, part: RolloutBatch) -> torch.Tensor:
        """Logprobs of `part`'s targets under the frozen warm-start policy (whole documents: cp=pp=1)."""
        return self.reference(part.input_ids, part.position_ids, part.cu_seqlens, compute_logits=False,
                              logprob_targets=part.targets).logprobs
