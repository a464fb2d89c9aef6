"""A ``transformers.Trainer`` run for tests/integrations/test_integration_transformers.py.

``python -m tests.integrations._hf_job URL OUT [--kill-at STEP] [--memory DIR]``: trains a
2-layer GPT-2 for 2 epochs of 5 steps (dropout on, shuffled batches) with Muon (CPU offload on)
through ``MuonCkptTrainer``, saving every 3 steps asynchronously to URL (the newest 2 kept),
and writes what the comparison needs to OUT (torch.save); ``--resume N`` names step N to
resume. With ``--kill-at``, once that step is trained (and the save before it committed) the
process SIGKILLs itself. Run it again on the same URL and it resumes. ``--memory``: every save
also goes to a memory tier in DIR.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile

import torch

EVERY, STEPS, SEQS, BATCH, SEQ_LEN, VOCAB = 3, 10, 20, 4, 16, 64


class Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences; records the indices it is asked for (the data order)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (SEQS, SEQ_LEN), generator=g)
        self.seen: list[int] = []

    def __len__(self) -> int:
        return SEQS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.seen.append(int(i))
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.1
    )
    return GPT2LMHeadModel(config)


def muon_for(model, total_steps: int):
    from transformers import get_linear_schedule_with_warmup

    from optim import Muon

    named = list(model.named_parameters())
    matrix = [(n, p) for n, p in named if p.ndim == 2 and ".wte." not in n and ".wpe." not in n]
    rest = [(n, p) for n, p in named if (n, p) not in matrix]
    opt = Muon(
        [
            {"params": [p for _, p in matrix], "lr": 0.02},
            {"params": [p for _, p in rest], "use_muon": False, "lr": 3e-3},
        ]
    )
    return opt, get_linear_schedule_with_warmup(opt, 2, total_steps)


def trainer_for(url: str, out_dir: str, *, callbacks=(), **options):
    from transformers import TrainingArguments

    from muon_ckpt.integrations.transformers import MuonCkptTrainer

    model = tiny_gpt2()
    opt, sched = muon_for(model, STEPS)
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=BATCH,
        num_train_epochs=STEPS * BATCH // SEQS,
        save_strategy="steps",
        save_steps=EVERY,
        save_total_limit=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    data = Tokens()
    trainer = MuonCkptTrainer(
        model=model,
        args=args,
        train_dataset=data,
        optimizers=(opt, sched),
        callbacks=list(callbacks),
        checkpoint_url=url,
        checkpoint_options={"async_save": True, **options},
        cpu_offload=True,
    )
    return trainer, data


def main() -> None:
    from transformers import TrainerCallback

    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("out")
    ap.add_argument("--kill-at", type=int)
    ap.add_argument("--memory")
    ap.add_argument("--resume", type=int, help="resume_from_checkpoint=<url>/step-<RESUME>")
    a = ap.parse_args()
    options = {}
    if a.memory:
        from muon_ckpt import MemoryOptions

        options["memory"] = MemoryOptions(interval=1, dir=a.memory)
    began: dict = {}

    class KillAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == a.kill_at:
                trainer._muon_manager.wait()  # the save before this step is committed
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_begin(self, args, state, control, **kwargs):
            mgr = trainer._muon_manager  # (made by the resume's load; None on a fresh start)
            began["tier"] = None if mgr is None else mgr.last_load_tier
            began["global_step"] = state.global_step
            named = kwargs["model"].named_parameters()
            began["params"] = {n: p.detach().clone() for n, p in named}

    with tempfile.TemporaryDirectory() as out_dir:
        trainer, data = trainer_for(a.url, out_dir, callbacks=[KillAt()], **options)
        trainer.train(None if a.resume is None else f"{a.url}/step-{a.resume:08d}")
        if trainer.args.process_index != 0:
            return  # (every rank of a DDP run ends with the same state)
        opt = trainer.optimizer.optimizer
        assert opt.cpu_offload  # on all along; read the states where they are parked
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        states = {
            n: {k: v.clone() for k, v in opt.cpu_state(p).items()}
            for n, p in trainer.model.named_parameters()
        }
        losses = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
        torch.save(
            {
                "resumed": trainer.resumed_step,
                "began": began,
                "params": params,
                "states": states,
                "sched": trainer.lr_scheduler.state_dict(),
                "global_step": trainer.state.global_step,
                "epoch": trainer.state.epoch,
                "losses": losses,
                "seen": data.seen,
                "rng": torch.random.get_rng_state(),
                "steps": sorted(int(p[5:]) for p in os.listdir(a.url) if p.startswith("step-")),
            },
            a.out,
        )


if __name__ == "__main__":
    main()
