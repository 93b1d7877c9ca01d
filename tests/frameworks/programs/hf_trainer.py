"""A Hugging Face Trainer program, unmodified for lockstep: a tiny GPT-2 built from a config, random tokens.

Run as `lockstep run -n 2 [--ddp lockstep] hf_trainer.py OUT [--hang-at-step K]`. Each rank writes
OUT/engine.rank<R>.txt (the module of the class that wrapped its model) and OUT/params.rank<R>.pt (its
final parameters). --hang-at-step K makes rank 1 sleep forever inside step K (a callback): a stuck rank.
"""

import os
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, length: int = 16, vocab: int = 64) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class HangAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step and int(os.environ.get("RANK", "0")) == 1:
            print(f"rank 1 stops inside step {self.step}", flush=True)
            while True:
                time.sleep(1)


def main() -> None:
    out = sys.argv[1]
    hang = int(sys.argv[sys.argv.index("--hang-at-step") + 1]) if "--hang-at-step" in sys.argv else None
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=os.path.join(out, "trainer"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    callbacks = [HangAt(hang)] if hang is not None else []
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out, f"engine.rank{rank}.txt"), "w") as fh:
        fh.write(type(trainer.model_wrapped).__module__)
    torch.save(
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        os.path.join(out, f"params.rank{rank}.pt"),
    )


if __name__ == "__main__":
    main()
