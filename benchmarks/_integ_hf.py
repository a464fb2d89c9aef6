"""bench_integrations' Hugging Face rows (not a test): the Trainer's own checkpoints
(``_save_checkpoint``: the model's safetensors, ``torch.save`` of the optimizer, scheduler and
RNG states, ``trainer_state.json``; resumed with ``resume_from_checkpoint=True``) against
``MuonCkptTrainer``'s, on the same ``Trainer.train`` of the same model and Muon."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

import torch

from benchmarks._integ import Case, Clock, Net, Row, data, run_cases

CASES = [
    Case("Trainer's own (`torch.save`)", False, ["hf", False, {}], ["checkpoint-*"]),
    Case("`MuonCkptTrainer`", True, ["muon", True, {}]),
    Case("`MuonCkptTrainer`, `async_save`", True, ["muon", True, {"async_save": True}]),
    Case("`MuonCkptTrainer`, `async_save`", False, ["muon", False, {"async_save": True}]),
]


def child(a: argparse.Namespace) -> dict[str, Any]:
    """One ``train()`` (``a.child``: path, offload, options) with a clock callback."""
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from muon_ckpt.integrations.transformers import MuonCkptTrainer
    from optim import Muon

    path, offload, options = json.loads(a.child)
    transformers.logging.set_verbosity_error()

    class HFNet(Net):
        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
            return {"loss": self.loss(input_ids, labels)}

    def muon(model: HFNet) -> Muon:
        mats, rest = model.muon_groups()
        return Muon([{"params": mats}, {"params": rest, "use_muon": False, "lr": 1e-3}])

    class ClockCallback(TrainerCallback):
        def __init__(self, clock: Clock) -> None:
            self.clock = clock

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.clock.start()

        def on_step_end(self, _: Any, state: Any, *__: Any, **___: Any) -> None:
            self.clock.end(state.global_step)

    def args(output_dir: str, max_steps: int, save: bool) -> TrainingArguments:
        return TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=8,
            max_steps=max_steps,
            save_strategy="steps" if save else "no",
            save_steps=a.every,
            save_total_limit=1,
            logging_strategy="no",
            report_to=[],
            disable_tqdm=True,
            use_cpu=True,
            seed=0,
        )

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokens, y = data(a)
    rows = [{"input_ids": t, "labels": v} for t, v in zip(tokens, y, strict=True)]
    # A first one-step train() warms this process up (lazy imports, first allocations), so
    # the timed run's time to its first batch differs between fresh and resumed by the
    # restore only.
    warm = HFNet(a.vocab, a.width)
    Trainer(
        model=warm,
        args=args(tempfile.mkdtemp(), 1, False),
        train_dataset=rows,
        optimizers=(muon(warm), None),
    ).train()

    clock = Clock()
    model = HFNet(a.vocab, a.width)
    if path == "hf":
        resume = os.path.isdir(a.dir) and any(
            n.startswith("checkpoint-") for n in os.listdir(a.dir)
        )
        trainer: Trainer = Trainer(
            model=model,
            args=args(a.dir, a.steps + 2 if resume else a.steps + 1, True),
            train_dataset=rows,
            optimizers=(muon(model), None),
            callbacks=[ClockCallback(clock)],
        )
        clock.begin()
        trainer.train(resume_from_checkpoint=True if resume else None)
    else:
        resume = os.path.isdir(a.dir)
        trainer = MuonCkptTrainer(
            model=model,
            args=args(tempfile.mkdtemp(), a.steps + 2 if resume else a.steps + 1, True),
            train_dataset=rows,
            optimizers=(muon(model), None),
            callbacks=[ClockCallback(clock)],
            checkpoint_url=a.dir,
            checkpoint_options=options,
            cpu_offload=offload,
        )
        clock.begin()
        trainer.train()  # (the pending save committed before it returns)
        if (trainer.resumed_step is not None) != resume:
            raise RuntimeError(f"{a.dir}: resumed step {trainer.resumed_step}, resume {resume}")
    return clock.result(a.every)


def rows(a: argparse.Namespace) -> list[Row]:
    return run_cases("transformers", "transformers", CASES, a)
