"""A Hugging Face Trainer with Muon (CPU offload on), saved and resumed by muon-ckpt.

    python examples/hf_trainer_muon.py [URL]     # default ./hf-checkpoints

Trains a small GPT-2 (built from a config: nothing is downloaded) for 60 steps on CPU,
saving every 20 in the background. Stop it at any point (Ctrl-C, kill -9) and run it again:
it resumes from the newest committed step, at the batch it stopped. At the end it exports
the weights in the Hugging Face layout and loads them back with from_pretrained.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, TrainingArguments

from muon_ckpt.integrations.transformers import MuonCkptTrainer
from optim import Muon


def main() -> None:
    url = sys.argv[1] if len(sys.argv) > 1 else "./hf-checkpoints"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    )
    named = list(model.named_parameters())
    matrices = [p for n, p in named if p.ndim == 2 and "wte" not in n and "wpe" not in n]
    others = [p for _, p in named if all(p is not m for m in matrices)]
    opt = Muon([{"params": matrices}, {"params": others, "use_muon": False, "lr": 3e-3}])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=60)
    tokens = torch.randint(0, 256, (240, 64), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),  # the Trainer's own files (none are checkpoints)
        per_device_train_batch_size=8,
        max_steps=60,
        save_steps=20,
        save_total_limit=2,  # keep_last
        logging_steps=10,
        report_to=[],
        use_cpu=True,
    )
    trainer = MuonCkptTrainer(
        model=model,
        args=args,
        train_dataset=data,
        optimizers=(opt, sched),
        checkpoint_url=url,
        checkpoint_options={"async_save": True},
        cpu_offload=True,  # turned on once accelerate has prepared the optimizer
    )
    trainer.train()  # resumes the url's newest committed step, if there is one
    print(f"resumed from step {trainer.resumed_step}; now at step {trainer.state.global_step}")

    out = tempfile.mkdtemp()
    tied = "lm_head.weight=transformer.wte.weight"
    subprocess.run(["muon-ckpt", "export", url, "--hf", out, "--tied", tied], check=True)
    model.config.save_pretrained(out)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    same = all(torch.equal(a, b) for a, b in zip(loaded.parameters(), model.parameters()))
    print(f"from_pretrained({out}): the same weights: {same}")


if __name__ == "__main__":
    main()
