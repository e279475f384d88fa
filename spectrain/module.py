"""`GRPOModule`: one GRPO step per batch of prompts, with manual optimization.

Each `training_step` rolls out `group_size` samples per prompt on the live engine, scores
them, computes group advantages, runs the policy's training forward (capturing the draft's
taps in the same pass) and steps the policy optimizer. The draft's optimizer is the
module's second optimizer; the `DraftCoTraining` callback steps it from the taps left in
`step_outputs`, and `WeightSync` pushes both models to the engine afterwards.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import lightning as L
import torch

from spectrain.config import SpecTrainConfig
from spectrain.models.llama import LlamaForCausalLM, default_aux_layer_ids
from spectrain.rl.batch import RolloutBatch, build_rollout_batch
from spectrain.rl.grpo import group_advantages, grpo_loss, token_logprobs
from spectrain.rollout.base import Completion, RolloutEngine, SamplingConfig, SpecDecodeCounters


@dataclass
class RolloutStats:
    seconds: float
    num_sequences: int
    num_tokens: int
    spec: SpecDecodeCounters  # this rollout's delta of the engine's counters

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class PolicyStepOutputs:
    """What the policy's training forward leaves for the draft: no second forward needed."""

    batch: RolloutBatch
    aux_hidden: list[torch.Tensor]  # detached residual streams entering the aux layers
    teacher_logits: torch.Tensor  # detached policy logits [T, V]


class GRPOModule(L.LightningModule):
    def __init__(self, config: SpecTrainConfig, policy: LlamaForCausalLM, draft: torch.nn.Module | None,
                 tokenizer, reward_fn) -> None:
        super().__init__()
        self.config = config
        self.policy = policy
        self.draft = draft
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.automatic_optimization = False
        self.engine: RolloutEngine | None = None  # attached by SpecTrainer; not checkpointed
        self.step_outputs: PolicyStepOutputs | None = None
        self.rollout_stats: RolloutStats | None = None

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        ids = self.config.draft.aux_layer_ids
        return tuple(ids) if ids is not None else default_aux_layer_ids(self.policy.cfg.num_hidden_layers)

    @property
    def trains_draft(self) -> bool:
        return self.draft is not None and self.config.draft.mode == "cotrained"

    def configure_optimizers(self):
        g = self.config.grpo
        policy_opt = torch.optim.AdamW(self.policy.parameters(), lr=g.lr, weight_decay=g.weight_decay)
        if self.draft is None:
            return policy_opt
        draft_opt = torch.optim.AdamW(self.draft.parameters(), lr=self.config.draft.lr, weight_decay=0.0)
        return [policy_opt, draft_opt]

    def policy_optimizer(self):
        opts = self.optimizers()
        return opts[0] if isinstance(opts, list) else opts

    # weight sync (PP overrides these to gather stages) ----------------------------------
    def policy_weights_for_sync(self):
        tied = self.policy.cfg.tie_word_embeddings
        return [(n, p.detach()) for n, p in self.policy.state_dict().items() if not (tied and n == "lm_head.weight")]

    def draft_weights_for_sync(self):
        from spectrain.models.eagle3 import draft_sync_weights

        return draft_sync_weights(self.draft)

    # rollout --------------------------------------------------------------------------
    def sampling_config(self, n: int, greedy: bool = False) -> SamplingConfig:
        r = self.config.rollout
        return SamplingConfig(n=n, max_tokens=r.max_new_tokens, temperature=0.0 if greedy else r.temperature,
                              top_p=r.top_p, seed=None if greedy else self.config.trainer.seed + self.global_step)

    def rollout(self, examples, n: int, greedy: bool = False) -> tuple[list[Completion], torch.Tensor, RolloutStats]:
        """Generate `n` samples per prompt and score them."""
        assert self.engine is not None, "no rollout engine attached: use SpecTrainer, or set module.engine"
        prompts = [self.tokenizer.encode_prompt(ex.prompt) for ex in examples]
        before = self.engine.spec_decode_counters()
        started = time.perf_counter()
        completions = self.engine.generate(prompts, self.sampling_config(n, greedy))
        seconds = time.perf_counter() - started
        spec = self.engine.spec_decode_counters() - before
        rewards = torch.tensor([self.reward_fn(self.tokenizer.decode(c.token_ids), examples[c.prompt_index].answer)
                                for c in completions], dtype=torch.float32)
        stats = RolloutStats(seconds, len(completions), sum(len(c.token_ids) for c in completions), spec)
        return completions, rewards, stats

    # training -------------------------------------------------------------------------
    def training_step(self, examples, batch_idx):
        g = self.config.grpo
        completions, rewards, self.rollout_stats = self.rollout(examples, self.config.rollout.group_size)
        advantages = group_advantages(rewards, self.config.rollout.group_size, g.adv_eps)
        batch = build_rollout_batch(completions, advantages)
        capture = self.aux_layer_ids if self.trains_draft else ()
        out = self.policy(batch.input_ids, batch.position_ids, batch.cu_seqlens, capture_layers=capture)
        logprobs = token_logprobs(out.logits, batch.targets)
        loss = grpo_loss(logprobs, logprobs.detach(), batch.advantages, batch.response_mask, g.clip_eps)
        opt = self.policy_optimizer()
        opt.zero_grad(set_to_none=True)
        self.manual_backward(loss.loss)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), g.grad_clip)
        opt.step()
        self.step_outputs = PolicyStepOutputs(batch, [h.detach() for h in out.aux_hidden], out.logits.detach())
        mask = batch.response_mask
        mismatch = (logprobs.detach() - batch.rollout_logprobs).abs()[mask]
        self.log_dict({
            "reward": rewards.mean(),
            "policy/loss": loss.loss.detach(),
            "policy/grad_norm": grad_norm,
            "policy/clip_fraction": loss.clip_fraction,
            "policy/engine_logprob_diff": mismatch.mean() if mismatch.numel() else torch.tensor(0.0),
            "rollout/tokens_per_s": self.rollout_stats.tokens_per_second,
            "rollout/seconds": self.rollout_stats.seconds,
            "rollout/mean_response_len": batch.num_response_tokens / batch.num_docs,
        }, prog_bar=False, on_step=True, batch_size=len(examples))
        self.log("reward_mean", rewards.mean(), prog_bar=True, on_step=True, batch_size=len(examples), logger=False)
        return loss.loss.detach()
