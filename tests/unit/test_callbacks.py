"""Callbacks' own logic: NaN guard, liveness check, counter deltas (error paths use stand-ins)."""
import math
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from spectrain.batch import build_rollout_batch
from spectrain.callbacks import (
    AcceptanceLengthLogger,
    BestCheckpoints,
    DraftCoTraining,
    HeldOutEval,
    SpeculationDeadError,
    WeightSync,
)
from spectrain.errors import ConfigError
from spectrain.models.eagle3 import Eagle3Config, Eagle3Draft
from spectrain.models.llama import LlamaConfig, LlamaForCausalLM, pack_sequences
from spectrain.parallel.plan import LocalPlan, draft_inputs_from, ttt_valid_tokens
from spectrain.rollout.engine import Completion, ProbeResult, SpecDecodeCounters
from spectrain.rollout.engine_layout import EngineLayout
from spectrain.train.online_draft import DraftTraining, OnlineDraft
from spectrain.train.step import bind_step_callbacks
from tests.helpers import StepModuleStandIn as Module
from tests.helpers import step_outputs, sync_step


def module_with_draft_inputs(**training):
    """A real draft (its owner set up as at fit start) and the taps of one policy forward."""
    torch.manual_seed(0)
    policy = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                          num_attention_heads=2, num_key_value_heads=1))
    model = Eagle3Draft(Eagle3Config.from_policy(policy.cfg))
    batch = build_rollout_batch([Completion(0, [1, 5, 6], [7, 8, 9, 2], [0.0] * 4, True),
                                 Completion(0, [1, 4], [3, 3, 2], [0.0] * 3, True)], torch.tensor([1.0, -1.0]))
    out = policy(batch.input_ids, batch.position_ids, batch.cu_seqlens, tap_layers=model.cfg.tap_layers)
    inputs = [draft_inputs_from(out, batch, policy.attention_ops, None, ttt_valid_tokens(batch))]
    draft = set_up(OnlineDraft(model, DraftTraining(**training)))
    return Module(draft=draft, draft_inputs=inputs, plan=LocalPlan(), logged={}, rollout_stats=stats(10, 25))


def set_up(draft: OnlineDraft) -> OnlineDraft:
    """The owner after the module's `on_fit_start`: its optimizer and lr ramp built over the draft."""
    draft.setup(lambda optimizer: optimizer.state_dict())
    return draft


def run_step(callback: DraftCoTraining, module, step: int):
    """The step's draft phase as GRPOModule runs it: the rollout's acceptance to the owner, the taps of each
    micro-batch when the callback starts an update, then the update."""
    module.draft.observe(module.rollout_stats.spec)
    if callback.begin_draft_update(module, step):
        for chunk in module.draft_inputs:
            callback.on_draft_taps(module, chunk)
    return callback.update_draft(module, step)


def test_draft_cotraining_steps_the_draft():
    module = module_with_draft_inputs(ttt_passes=2, lr=0.1, lr_ramp_updates=1)
    before = [p.detach().clone() for p in module.draft.model.parameters()]
    report = run_step(DraftCoTraining(), module, 1)
    assert any(not torch.equal(a, b) for a, b in zip(before, module.draft.model.parameters()))
    assert report.applied and report.version == module.draft.version == 1 and len(report.pass_top1) == 2
    assert module.logged["draft/skipped_steps"] == 0 and "draft/pass_2_top1" in module.logged
    assert module.logged["draft/lr"] == pytest.approx(0.05)  # the ramp's first step: lr / (lr_ramp_updates + 1)
    assert module.draft.lr_ramp.last_epoch == 1 and module.draft.lr == pytest.approx(0.1)


def test_nan_guard_skips_the_draft_update():
    module = module_with_draft_inputs(ttt_passes=2)
    module.draft_inputs[0].teacher_logits.fill_(float("nan"))
    before = [p.detach().clone() for p in module.draft.model.parameters()]
    with pytest.warns(UserWarning, match=r"draft update skipped \(step 1, 1 skipped so far\): loss nan, gradient norm "
                                         r"nan: not finite\. The draft and its optimizer are unchanged"):
        report = run_step(DraftCoTraining(), module, 1)
    assert not report.applied and module.draft.version == 0  # nothing changed: nothing to re-send
    assert all(torch.equal(a, b) for a, b in zip(before, module.draft.model.parameters()))
    assert module.draft.updates_skipped == 1 and module.logged["draft/skipped_steps"] == 1
    assert module.draft.lr_ramp.last_epoch == 0  # a skipped update does not advance the lr ramp
    state = module.draft.state_dict()
    assert (state["updates_applied"], state["updates_skipped"]) == (0, 1) and not state["optimizer"]["state"]


def test_every_n_steps():
    module = module_with_draft_inputs(every_n_steps=2, ttt_passes=1)
    losses = []
    for step in (1, 2, 3):
        run_step(DraftCoTraining(), module, step)
        losses.append(module.logged["draft/loss"])
    assert module.draft.updates_applied == 2  # steps 1 and 3
    # the step in between logs NaN: a missing value would make Lightning repeat step 1's
    assert math.isfinite(losses[0]) and math.isnan(losses[1]) and math.isfinite(losses[2])


def test_hold_skips_updates_while_acceptance_is_flat_and_resumes_them_when_it_drops_or_climbs():
    module = module_with_draft_inputs(ttt_passes=1, hold_tolerance=0.1, max_held_steps=3)
    callback, updated = DraftCoTraining(), []
    for step, accepted in enumerate([50, 50, 48, 50, 50, 50, 50, 30, 30], start=1):  # gains 2.5 ... 1.5
        module.rollout_stats = stats(20, accepted)  # what the step's rollout (before its update) measured
        run_step(callback, module, step)
        updated.append(module.logged["draft/updated"])
    # step 1: too little history; 2-4: 2.5, 2.4, 2.5 hold (within 0.1 x the mean 2.5); 5: max_held_steps=3 forces
    # one; 6-7 hold; 8: this rollout's gain 1.5, far under the mean, brings the update back; 9: 1.5 is not within
    # 0.1 x the mean of the rollouts before (mostly 2.5)
    assert updated == [1, 0, 0, 0, 1, 0, 0, 1, 1]
    assert module.draft.updates_applied == 4
    resumed = OnlineDraft(module.draft.model, module.draft.training)
    resumed.load_state_dict(module.draft.state_dict())
    assert (resumed.acceptance, resumed.steps_without_update) == (module.draft.acceptance, 0)
    assert OnlineDraft(module.draft.model).holds() is False  # hold_tolerance=0: never

    climbing = OnlineDraft(module.draft.model, DraftTraining(hold_tolerance=0.1))  # a cold draft learning
    climbing.acceptance = [1.0, 1.2, 1.4, 1.6]
    assert climbing.holds() is False
    climbing.acceptance = [1.6, 1.62, 1.58, 1.61]  # flat again
    assert climbing.holds() is True


def same_optimizer_state(a: dict, b: dict) -> bool:
    return a["state"].keys() == b["state"].keys() and all(
        torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in ("exp_avg", "exp_avg_sq"))


def test_the_draft_optimizer_and_lr_ramp_resume_from_the_owner_state():
    module = module_with_draft_inputs(ttt_passes=1)
    run_step(DraftCoTraining(), module, 1)
    saved = module.draft.state_dict()
    resumed = OnlineDraft(module.draft.model, module.draft.training)
    resumed.load_state_dict(saved)  # Lightning restores the checkpoint before `on_fit_start` builds the optimizer
    set_up(resumed)
    assert same_optimizer_state(resumed.optimizer.state_dict(), saved["optimizer"])
    assert resumed.lr_ramp.last_epoch == 1 and resumed.updates_applied == 1 and resumed.version == 1
    assert resumed.lr == module.draft.lr  # the ramp's 2nd rate


def test_step_callbacks_are_bound_once_and_their_order_is_checked():
    sync, cotraining = WeightSync(), DraftCoTraining()
    bound = bind_step_callbacks([cotraining, sync, AcceptanceLengthLogger()])
    assert bound.draft_updater is cotraining and bound.weight_syncer is sync
    with pytest.raises(ConfigError, match=r"2 callbacks run the step's weight_sync phase \(WeightSync, WeightSync\)"):
        bind_step_callbacks([sync, WeightSync()])
    best = BestCheckpoints("best", "greedy_reward", "max", 1, 1)
    held_out = HeldOutEval([], 1, 1)
    bind_step_callbacks([held_out, best, ModelCheckpoint()])
    with pytest.raises(ConfigError, match="BestCheckpoints must come after HeldOutEval"):
        bind_step_callbacks([best, held_out])


def trainer_at(step):
    return SimpleNamespace(global_step=step)


def stats(drafts, accepted):
    spec = SpecDecodeCounters(drafts, 3 * drafts, accepted, [accepted, 0, 0])
    return SimpleNamespace(spec=spec, per_engine_acceptance=[spec.mean_acceptance_length])


def sync_module(engine, draft_model=None, **fields):
    """A stand-in module whose draft owner holds `draft_model` (a real module; the engine is a stand-in)."""
    draft_model = draft_model or torch.nn.Linear(2, 2)
    return Module(engine=engine, engines=EngineLayout.single(), plan=LocalPlan(), policy=torch.nn.Linear(2, 2),
                  draft=OnlineDraft(draft_model), logged={}, policy_weights_for_sync=lambda: [],
                  draft_weights_for_sync=lambda: list(draft_model.named_parameters()), **fields)


@pytest.mark.parametrize("fault", [[], ["midlayer.mlp.down_proj: relative error 1.0e+00 > 1e-04"]])
def test_an_acceptance_of_nothing_is_dead_only_if_the_drafter_is_not_the_synced_draft(fault):
    probe = ProbeResult(0.0, [])  # what the engine's probe reports (a mock: this is the error path)
    engine = SimpleNamespace(sync_policy=lambda w, v: None, sync_draft=lambda w, v: None,
                             verify_weights=lambda w, which, rtol: probe)
    module = sync_module(engine)
    callback = WeightSync()
    callback.on_train_start(trainer_at(0), module)  # synced and verified
    module.rollout_stats = stats(drafts=50, accepted=7)
    sync_step(callback, module, 1)  # alive: fine
    probe.mismatches = fault  # the drafter was lost after that sync, or not
    module.rollout_stats = stats(drafts=50, accepted=0)
    if fault:
        with pytest.raises(SpeculationDeadError, match=r"acceptance length is 1\.00 over 50 drafts, and the drafter is "
                                                       r"not the synced draft \(midlayer\.mlp\.down_proj"):
            sync_step(callback, module, 2)
        return
    with pytest.warns(UserWarning, match="the engine serves the synced draft"):
        sync_step(callback, module, 2)
    assert not callback.speculation_disabled


def test_an_acceptance_of_nothing_after_a_wake_from_sleep_mode_is_dead_even_with_the_synced_draft():
    """rollout.enable_sleep_mode: the module wakes the engine before each sync; a rollout after a wake that accepts
    nothing means the drafter was lost on wake, whatever the probe says (a stand-in engine: the error path)."""
    engine = SimpleNamespace(sync_policy=lambda w, v: None, sync_draft=lambda w, v: None,
                             verify_weights=lambda w, which, rtol: ProbeResult(0.0, []))
    module = sync_module(engine)
    callback = WeightSync()
    callback.on_train_start(trainer_at(0), module)
    module.rollout_stats = stats(drafts=50, accepted=7)  # before any wake: checked as usual
    sync_step(callback, module, 1, woke=True)  # woken before the step-1 sync
    module.rollout_stats = stats(drafts=50, accepted=0)
    with pytest.raises(SpeculationDeadError, match=r"woke from sleep mode .* exactly 1\.00 over 50 drafts: the "
                                                   r"drafter was lost on wake \(set rollout.enable_sleep_mode=false"):
        sync_step(callback, module, 2)


def test_the_draft_is_re_sent_only_after_it_changed():
    """A step without a draft update (draft.every_n_steps, draft.hold_tolerance) syncs the policy alone; an applied
    update of the draft makes the next sync send it, as the owner's version (stand-in engine: it records what it
    is sent)."""
    sent = []
    engine = SimpleNamespace(sync_policy=lambda w, v: sent.append(("policy", v)),
                             sync_draft=lambda w, v: sent.append(("draft", v)),
                             verify_weights=lambda w, which, rtol: ProbeResult(0.0, []))
    module = sync_module(engine, rollout_stats=stats(drafts=50, accepted=70))
    callback = WeightSync()
    versions = []
    for step, updated in enumerate([True, False, False, True], start=1):
        if updated:
            module.draft.version += 1  # what an applied update does
        versions.append(sync_step(callback, module, step).draft_version)
    assert sent == [("policy", 1), ("draft", 1), ("policy", 2), ("policy", 3), ("policy", 4), ("draft", 2)]
    assert versions == [1, None, None, 2] and module.draft.sent_version == 2


def test_acceptance_logger_logs_deltas(tmp_path):
    module = Module(plan=LocalPlan(), logged={}, rollout_stats=stats(drafts=10, accepted=15))
    logger = AcceptanceLengthLogger(plot_path=str(tmp_path / "acc.png"))
    logger.on_train_batch_end(trainer_at(1), module, step_outputs(module), None, 0)
    assert module.logged["spec/mean_acceptance_length"] == pytest.approx(2.5)
    assert module.logged["spec/acceptance_rate"] == pytest.approx(0.5)
    assert module.logged["spec/pos_0_rate"] == pytest.approx(1.5)
    module.rollout_stats = stats(drafts=0, accepted=0)  # a step that drafted nothing (k=0) logs NaN
    logger.on_train_batch_end(trainer_at(2), module, step_outputs(module), None, 0)
    assert math.isnan(module.logged["spec/mean_acceptance_length"]) and len(logger.history) == 1
    logger.on_train_end(SimpleNamespace(default_root_dir=str(tmp_path)), module)
    assert (tmp_path / "acc.png").is_file()


def test_counter_deltas():
    a = SpecDecodeCounters(10, 30, 12, [8, 3, 1])
    b = SpecDecodeCounters(4, 12, 6, [4, 2])
    d = a - b
    assert (d.num_drafts, d.num_accepted_tokens, d.accepted_per_pos) == (6, 6, [4, 1, 1])
    assert d.mean_acceptance_length == 2.0 and SpecDecodeCounters().mean_acceptance_length == 1.0


def test_packed_helper_round_trip():
    ids, pos, cu = pack_sequences([[1, 2], [3]])
    assert ids.tolist() == [1, 2, 3] and pos.tolist() == [0, 1, 0] and cu.tolist() == [0, 2, 3]


def test_stop_on_signal_checkpoints_at_the_step_boundary(tmp_path):
    import os
    import signal

    from spectrain.callbacks import StopOnSignal

    saved = []
    trainer = SimpleNamespace(global_step=3, is_global_zero=True, should_stop=False,
                              strategy=SimpleNamespace(reduce=lambda t, reduce_op: t), save_checkpoint=saved.append)
    callback = StopOnSignal(str(tmp_path / "last.ckpt"))
    before = signal.getsignal(signal.SIGTERM)
    callback.on_train_start(trainer, None)
    try:
        callback.on_train_batch_end(trainer, None, None, None, 0)
        assert not saved and not trainer.should_stop  # no signal: nothing happens
        os.kill(os.getpid(), signal.SIGTERM)  # noted only: the step in flight finishes
        os.kill(os.getpid(), signal.SIGINT)  # a different signal (torchrun's follow-up) does not abort
        callback.on_train_batch_end(trainer, None, None, None, 0)
        assert saved == [str(tmp_path / "last.ckpt")] and trainer.should_stop
        error = callback.interruption(trainer.global_step)
        assert error.exit_code == 143 and "SIGTERM after 3 steps" in str(error) and "resume" in str(error)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)  # the same signal again: abort now
    finally:
        callback.teardown(trainer, None, "fit")
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_signal_outside_the_loop_is_not_swallowed_by_an_except_exception_in_the_code_it_lands_in():
    import os
    import signal

    from spectrain.callbacks import InterruptOnSignal, RunInterrupted

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RunInterrupted) as stopped:
        with InterruptOnSignal() as signals:
            signals.phase = "the engine start"
            try:  # as in much of vLLM's start-up
                os.kill(os.getpid(), signal.SIGTERM)
            except Exception:
                pass
            raise AssertionError("the signal was swallowed")
    assert stopped.value.exit_code == 143 and "SIGTERM during the engine start" in str(stopped.value)
    assert signal.getsignal(signal.SIGTERM) == before


def test_every_overridden_hook_says_so():
    """Lightning's convention: `@override` on each hook, so a renamed hook fails loudly instead of never running."""
    from lightning.pytorch.callbacks import Callback

    import spectrain.callbacks as callbacks

    for cls in (c for c in vars(callbacks).values() if isinstance(c, type) and issubclass(c, Callback)):
        for name, member in vars(cls).items():
            if hasattr(Callback, name) and not name.startswith("__"):
                function = member.fget if isinstance(member, property) else member
                assert getattr(function, "__override__", False), f"{cls.__name__}.{name} lacks @override"


def test_held_out_evaluations_keep_their_own_checkpoint_state():
    from spectrain.callbacks import HeldOutEval

    every_10, every_5 = (HeldOutEval([1, 2], every_n_steps=10, samples=8),
                         HeldOutEval([1, 2], every_n_steps=5, samples=8))
    assert every_10.state_key != every_5.state_key
    assert every_10.state_key == HeldOutEval([3, 4], every_n_steps=10, samples=8).state_key  # what a resume rebuilds


def test_a_checkpoint_with_the_history_under_the_class_name_is_refused():
    """Only today's layout is read: a history kept under the bare class name is refused in one line."""
    from spectrain.callbacks import HeldOutEval, RunHistory
    from spectrain.errors import RunDirError

    old = {"callbacks": {"HeldOutEval": {"history": [{"step": 0, "greedy_reward": 0.5}]},
                         "RunHistory": {"history": []}}}
    evaluation = HeldOutEval([1, 2], every_n_steps=10, samples=8)
    with pytest.raises(RunDirError, match=r"^the checkpoint keeps the held-out evaluation under 'HeldOutEval'.*"
                                          r"another trainer\.run_dir$") as err:
        evaluation.on_load_checkpoint(None, None, old)
    assert "\n" not in str(err.value)
    # the trainer's own plots keep the class name; another with its own plot path checkpoints beside them
    assert RunHistory().state_key == "RunHistory" and AcceptanceLengthLogger().state_key == "AcceptanceLengthLogger"
    assert RunHistory(plot_path="copy.png").state_key != RunHistory().state_key
