"""`SampleGenerations`: every N steps, a small table of the rollout's generations, to every logger and a JSONL file."""
from __future__ import annotations

import json
from pathlib import Path

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

COLUMNS = ["step", "prompt", "completion", "reward", "advantage", "completion_tokens", "step_acceptance_length"]


class SampleGenerations(Callback):
    """Every `every_n_steps` steps, `n` completions of the step's rollout (evenly spread over the batch, so
    over its prompts): prompt, completion, reward, advantage, completion length and the step's mean acceptance
    length (vLLM counts accepted tokens per step, not per completion; None when nothing was drafted).

    Written, on rank 0, to `path` (default `<run_dir>/samples.jsonl`, one line per sample) and to each of the
    trainer's loggers that holds tables or text: wandb `log_table("samples")`, MLflow the artifact
    `samples/step_NNNNNN.json` (`{"columns", "data"}`, as `mlflow.log_table` writes it), TensorBoard the text
    `samples` (a markdown table). A resumed run first drops the lines of the steps it re-runs. No state.
    """

    def __init__(self, every_n_steps: int = 10, n: int = 4, path: str | None = None) -> None:
        self.every_n_steps, self.n, self.path = every_n_steps, n, path

    def _path(self, trainer) -> Path:
        return Path(self.path or Path(trainer.default_root_dir) / "samples.jsonl")

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        path = self._path(trainer)
        if trainer.is_global_zero and path.is_file():  # a resume re-runs the steps after its checkpoint
            lines = path.read_text().splitlines()
            kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= trainer.global_step]
            if len(kept) < len(lines):
                path.write_text("".join(f"{line}\n" for line in kept))

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = outputs["step"]
        if not self.every_n_steps or step.step % self.every_n_steps or not trainer.is_global_zero:
            return
        rows = self.rows(step, pl_module.tokenizer)
        path = self._path(trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.writelines(json.dumps(dict(zip(COLUMNS, row))) + "\n" for row in rows)
        for logger in trainer.loggers:
            write_table(logger, rows, step.step)

    def rows(self, step, tokenizer) -> list[list]:
        """The table's rows (in `COLUMNS` order) for a `StepResult`."""
        b = step.batch
        docs = b.num_docs
        picks = sorted({i * docs // self.n for i in range(min(self.n, docs))})
        # dynamic sampling may have dropped documents: then the batch's i-th is no longer the i-th reward
        rewards = step.rewards.tolist() if step.rewards.numel() == docs else None
        spec = step.rollout.spec
        accept = spec.mean_acceptance_length if spec.num_drafts else None
        bounds, mask, ids = b.cu_seqlens.tolist(), b.response_mask.cpu(), b.input_ids.cpu()
        rows = []
        for i in picks:
            start, end = bounds[i], bounds[i + 1]
            response = mask[start:end].nonzero()
            # position t predicts token t + 1: the completion starts one after the first response position
            first = start + int(response[0]) + 1 if response.numel() else end
            prompt, completion = tokenizer.decode(ids[start:first].tolist()), tokenizer.decode(ids[first:end].tolist())
            reward = None if rewards is None else float(rewards[i])
            rows.append([step.step, prompt, completion, reward, float(b.advantages[start]), end - first, accept])
        return rows


def write_table(logger, rows: list[list], step: int) -> None:
    """The sample table to one Lightning logger, in the form it shows (csv: none, the JSONL file is its record)."""
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger

    if isinstance(logger, WandbLogger):
        logger.log_table(key="samples", columns=COLUMNS, data=rows, step=step)
    elif isinstance(logger, MLFlowLogger):
        logger.experiment.log_text(logger.run_id, json.dumps({"columns": COLUMNS, "data": rows}, indent=1),
                                   f"samples/step_{step:06d}.json")
    elif isinstance(logger, TensorBoardLogger):
        cell = lambda v: str(v).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
        table = "\n".join(["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
                          + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])
        logger.experiment.add_text("samples", table, global_step=step)
