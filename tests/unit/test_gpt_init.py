"""The gpt job's TinyGPT starts where an untrained language model should: at about a uniform guess's loss.

With torch's default initialisation (the embedding N(0, 1), tied to the head) the untrained model's loss
was about ten times ln(vocab) and the first training steps blew up (mean train loss 41.9 over the first
10 steps of `lockstep train gpt -n 2 --batch-size 16`); GPT-2's initialisation (jobs/models.py) fixes it.
"""

from __future__ import annotations

import math

import pytest
import torch

from lockstep.jobs.models import INIT_STD, TinyGPT


@pytest.mark.parametrize(("vocab", "dim", "depth"), [(96, 64, 2), (200, 256, 4), (50, 32, 1)])
def test_untrained_loss_on_random_tokens_is_near_ln_vocab(vocab: int, dim: int, depth: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab, context=32, dim=dim, depth=depth)
    tokens = torch.randint(vocab, (8, 33))
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)).item()
    assert abs(loss - math.log(vocab)) <= 0.1 * math.log(vocab), (loss, math.log(vocab))


def test_weights_follow_gpt2s_initialisation() -> None:
    torch.manual_seed(0)
    depth = 4
    model = TinyGPT(500, context=64, dim=256, depth=depth)
    assert model.head.weight is model.token.weight  # still tied
    assert model.token.weight.std().item() == pytest.approx(INIT_STD, rel=0.05)
    block = model.blocks[0]
    assert block.attn.qkv.weight.std().item() == pytest.approx(INIT_STD, rel=0.05)
    residual = INIT_STD / math.sqrt(2 * depth)
    assert block.attn.proj.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert block.mlp[2].weight.std().item() == pytest.approx(residual, rel=0.05)
    assert all(
        float(b.detach().abs().max()) == 0.0
        for name, b in model.named_parameters()
        if name.endswith("bias") and "ln" not in name and "norm" not in name
    )
