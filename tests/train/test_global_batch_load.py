"""The global-batch aux loss with the current step's load (`model.moe.global_batch_load` "this_step"): the routing
pre-pass (train/router_step.py `route_step_ahead`) gives every micro-batch of the step the step's own f, worked out here
by hand (math.exp, never moe.py); against the previous step's f ("previous_step") it moves the router from step 1;
and on a real decoder the pre-pass's f is the f of the training forwards' own assignments. Layout equivalence
(dp = 2 with ep = 2, tp = 2, and an ep = 2 checkpoint resumed in one process) is the `recipes` mode of
tests/parallel/test_ep_e2e.py and test_tp_e2e.py."""

import math

import pytest
import torch

from moe_dist.config import MoEConfig, load_config
from moe_dist.layers.moe import moe_routers
from moe_dist.layers.router import Router
from moe_dist.models.decoder import build_model, materialize_whole
from moe_dist.train.router_step import route_step_ahead

# Softmax over E = 3 experts, top-1; the router weight is the identity, so the rows are the logits. One optimizer
# step of two micro-batches: experts [0, 0] and [1, 2, 1], so the step's f = [2, 2, 1] / 5.
MICRO_BATCHES = [
    [[1.0, 0.0, 0.0], [2.0, 0.0, 1.0]],
    [[0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [0.5, 2.0, 0.0]],
]
STEP_F = [2 / 5, 2 / 5, 1 / 5]


def softmax_row(row):
    z = sum(math.exp(v) for v in row)
    return [math.exp(v) / z for v in row]


def hand_aux(f, rows):
    """E · Σ_i f_i · P_i with P_i the mean softmax probability of expert i over the micro-batch's rows."""
    p = [softmax_row(r) for r in rows]
    P = [sum(pt[e] for pt in p) / len(p) for e in range(3)]
    return 3 * sum(fi * Pi for fi, Pi in zip(f, P))


def router(load: str) -> Router:
    cfg = MoEConfig(num_experts=3, top_k=1, capacity_factor=None, aux_loss_scope="global_batch")
    r = Router(3, MoEConfig(**{**cfg.__dict__, "global_batch_load": load}), init_std=0.02)
    r.init_weights()
    with torch.no_grad():
        r.weight.copy_(torch.eye(3))
    return r


def prepass(r: Router, batches=MICRO_BATCHES, counted: bool = True) -> None:
    """The routing pre-pass of one step whose micro-batches are `batches` (rows of logits)."""
    route_step_ahead([r], lambda rows: [r(torch.tensor(rows).reshape(-1, 3))[1]], batches, counted=counted)


def micro_steps(r: Router) -> list:
    """The step's training forwards, one per micro-batch: their RoutingStats."""
    return [r(torch.tensor(rows))[1] for rows in MICRO_BATCHES]


def test_this_step_aux_loss_uses_the_steps_own_load_hand_worked():
    r = router("this_step")
    prepass(r)
    assert r.load_E.tolist() == pytest.approx(STEP_F, rel=1e-7)
    stats = micro_steps(r)
    for rows, s in zip(MICRO_BATCHES, stats):
        assert s.aux_loss.item() == pytest.approx(hand_aux(STEP_F, rows), rel=1e-6)
        # neither the micro-batch's own f nor the uniform f of "no previous step"
        own_f = [c / len(rows) for c in s.tokens_per_expert_E.tolist()]
        assert s.aux_loss.item() != pytest.approx(hand_aux(own_f, rows), rel=1e-3)
        assert s.aux_loss.item() != pytest.approx(1.0, rel=1e-3)
    # the telemetry of the training forwards is their own, whatever the pre-pass routed
    assert [s.tokens_per_expert_E.tolist() for s in stats] == [[2.0, 0.0, 0.0], [0.0, 2.0, 1.0]]
    r.end_step(sum(s.tokens_per_expert_E for s in stats).double())  # "this_step": end_step leaves load_E alone
    assert r.load_E.tolist() == pytest.approx(STEP_F, rel=1e-7)


def test_a_step_without_assignments_keeps_the_load_and_uncounted_ranks_add_nothing():
    r = router("this_step")
    prepass(r)
    prepass(r, [[], []])  # micro-batches without tokens
    assert r.load_E.tolist() == pytest.approx(STEP_F, rel=1e-7)  # no NaN from 0 / 0
    prepass(r, MICRO_BATCHES[1:], counted=False)
    assert r.load_E.tolist() == pytest.approx(STEP_F, rel=1e-7)  # a TP peer's counts: zeros, so nothing changes


def test_step_one_moves_the_router_with_this_step_and_not_with_previous_step():
    """Softmax: with uniform f (no previous step) the aux loss is Σ_i P_i = 1 for every router weight, so its
    gradient is zero; the step's own f gives a gradient at step 1 already."""
    grads = {}
    for load in ("this_step", "previous_step"):
        r = router(load)
        if load == "this_step":
            prepass(r)
        stats = micro_steps(r)
        torch.stack([s.aux_loss for s in stats]).mean().backward()
        grads[load] = r.weight.grad.abs().max().item()
        if load == "previous_step":
            assert all(s.aux_loss.item() == pytest.approx(1.0, abs=1e-6) for s in stats)
    assert grads["previous_step"] < 1e-7
    assert grads["this_step"] > 1e-2
    # previous_step is the old behaviour: end_step sets the f the next step uses
    r = router("previous_step")
    r.end_step(torch.tensor([2.0, 2.0, 1.0], dtype=torch.float64))
    assert r.load_E.tolist() == pytest.approx(STEP_F, rel=1e-7)


def test_prepass_load_is_the_training_forwards_own_load_on_a_decoder(one_thread):
    """configs/debug.json's decoder (attention, Mamba, two MoE layers, capacity drops), four micro-batches: the
    pre-pass sets each layer's f to the fractions of the assignments the training forwards then make, and the
    pre-pass leaves those forwards' outputs and statistics unchanged (bitwise, against a model without it)."""
    cfg = load_config("configs/debug.json", ["model.moe.aux_loss_scope=global_batch"])
    model = materialize_whole(build_model(cfg.model), "cpu", seed=0)
    twin = materialize_whole(build_model(cfg.model), "cpu", seed=0)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.model.vocab_size, (2, 32), generator=g) for _ in range(4)]
    route_step_ahead(moe_routers(model), lambda x: model(x).moe_stats, batches, counted=True)
    outs = [model(x) for x in batches]
    counts_LE = sum(torch.stack([s.tokens_per_expert_E for s in out.moe_stats]) for out in outs)
    for router_, counts_E in zip(moe_routers(model), counts_LE, strict=True):
        assert torch.allclose(router_.load_E, counts_E / counts_E.sum(), rtol=0, atol=1e-7)
        assert (router_.load_E - 1 / cfg.model.moe.num_experts).abs().max() > 1e-3  # not the uniform start
    for x, out in zip(batches, outs):
        ref = twin(x)  # the same weights, uniform load_E
        assert torch.equal(out.logits, ref.logits)  # load_E enters no output, only the aux loss
        assert out.aux_loss.item() != pytest.approx(ref.aux_loss.item(), rel=1e-6)
        for s, t in zip(out.moe_stats, ref.moe_stats):
            assert torch.equal(s.tokens_per_expert_E, t.tokens_per_expert_E) and torch.equal(s.dropped, t.dropped)


def test_prepass_changes_nothing_under_activation_recompute(one_thread):
    """The pre-pass's no-grad forwards bypass the recompute wrappers: a step of four micro-batches (pre-pass, then
    forward and backward of each) gives the same aux losses, loads and gradients with every part recomputed as
    without recompute, bitwise."""
    from moe_dist.models.activation_checkpointing import apply_activation_checkpointing

    cfg = load_config(
        "configs/debug.json", ["model.moe.aux_loss_scope=global_batch", "train.activation_checkpointing=full"]
    )
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.model.vocab_size, (2, 32), generator=g) for _ in range(4)]
    results = []
    for recompute in (False, True):
        model = materialize_whole(build_model(cfg.model), "cpu", seed=0)
        if recompute:
            apply_activation_checkpointing(model, cfg.train)
        route_step_ahead(moe_routers(model), lambda x, m=model: m(x).moe_stats, batches, counted=True)
        aux = []
        for x in batches:
            out = model(x)
            (out.aux_loss + out.logits.float().square().mean()).backward()
            aux.append(out.aux_loss.item())
        loads = [r.load_E.clone() for r in moe_routers(model)]
        results.append((aux, loads, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (aux, loads, grads), (aux_r, loads_r, grads_r) = results
    assert aux == aux_r and all(torch.equal(a, b) for a, b in zip(loads, loads_r))
    assert grads.keys() == grads_r.keys() and all(torch.equal(grads[n], grads_r[n]) for n in grads)
