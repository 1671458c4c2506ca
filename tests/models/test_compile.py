"""train.compile: the compiled parts (norms, attention, dense FFNs) give the eager model's loss and gradients
within fp32 round-off, and the same loss after an optimizer step; parameter names are unchanged."""

import pytest
import torch

from moe_dist.config import load_config
from moe_dist.models.compile import maybe_compile
from moe_dist.models.decoder import build_model, lm_loss, materialize_whole
from moe_dist.train.optim import build_optimizer


@pytest.mark.slow  # compiling takes tens of seconds on 2 CPU cores
def test_compile_on_equals_off():
    results = {}
    for compile_ in (False, True):
        cfg = load_config("configs/debug.json", [f"train.compile={str(compile_).lower()}"])
        model = maybe_compile(materialize_whole(build_model(cfg.model), "cpu", cfg.train.seed), cfg)
        assert (model.blocks[0].mixer_norm._compiled_call_impl is not None) == compile_
        optimizer, _ = build_optimizer(model, cfg)
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
        losses, grads = [], {}
        for step in range(2):
            out = model(tokens[:, :-1])
            loss = lm_loss(out.logits, tokens[:, 1:]) + 0.01 * out.aux_loss + 0.001 * out.z_loss
            loss.backward()
            losses.append(loss.detach())
            if step == 0:
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
        results[compile_] = (losses, grads)
    (losses0, grads0), (losses1, grads1) = results[False], results[True]
    # (parameters are not compared after the step: Adam's first update, lr · g / |g|, turns round-off in
    # near-zero gradients into lr-sized differences; the loss after the step is what must not move)
    torch.testing.assert_close(torch.stack(losses1), torch.stack(losses0), rtol=1e-5, atol=1e-6)
    assert grads1.keys() == grads0.keys()  # same names: checkpoints unchanged
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-4, atol=1e-6, msg=name)
