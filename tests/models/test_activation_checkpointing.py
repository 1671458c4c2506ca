"""Activation checkpointing (models/activation_checkpointing.py): training with any recompute setting follows the
run without it exactly (fp32, CPU: the same ops in the same order, so bitwise), routing statistics are counted
once, and each part really stops saving its interior. The EP and TP layouts with recompute:
tests/parallel/test_tp_e2e.py."""

import pytest
import torch

from moe_dist.config import ConfigError, load_config
from moe_dist.models.activation_checkpointing import apply_activation_checkpointing
from moe_dist.models.decoder import build_model, lm_loss, materialize_whole

SETTINGS = {
    "none": [],
    "full": ["train.activation_checkpointing=full"],
    "moe_experts": ["train.activation_checkpointing=selective", 'train.checkpoint_parts=["moe_experts"]'],
    "mixers": ["train.activation_checkpointing=selective", 'train.checkpoint_parts=["attention","mamba"]'],
    "mlp": ["train.activation_checkpointing=selective", 'train.checkpoint_parts=["mlp"]'],
    "new_mixers": ["train.activation_checkpointing=selective", 'train.checkpoint_parts=["mamba2","gdn"]'],
}
# A layer list with every mixer kind (the debug model's widths), for the recompute of Mamba-2 and Gated DeltaNet.
EVERY_MIXER = [
    "model.mixer_pattern=A",
    "model.ffn_pattern=E",
    'model.layers=["attention+moe","mamba2+mlp","gdn+moe","mamba1+mlp"]',
    "model.mamba2.head_dim=16",
    "model.gdn.head_k_dim=16",
    "model.gdn.head_v_dim=16",
]


def _model(setting: str, *extra: str):
    cfg = load_config("configs/debug.json", [*SETTINGS[setting], *extra])
    return apply_activation_checkpointing(materialize_whole(build_model(cfg.model), "cpu", seed=3), cfg.train), cfg


def _train(setting: str, steps: int = 3, micro: int = 2, *extra: str) -> list[dict]:
    """`steps` AdamW steps over `micro` micro-batches each (gradient accumulation, clipping at 1.0); per step the
    loss, the gradient norm, every MoE layer's tokens per expert, drops, aux and z losses, and the final state."""
    model, cfg = _model(setting, *extra)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    records = []
    for _ in range(steps):
        rec = {"loss": 0.0, "tokens": [], "dropped": [], "aux": 0.0, "z": 0.0}
        for _ in range(micro):
            batch = torch.randint(0, 256, (2, 33), generator=gen)
            out = model(batch[:, :-1])
            moe = cfg.model.moe
            loss = lm_loss(out.logits, batch[:, 1:]) + moe.aux_loss_coef * out.aux_loss + moe.z_loss_coef * out.z_loss
            (loss / micro).backward()
            rec["loss"] += loss.item()
            rec["aux"] += out.aux_loss.item()
            rec["z"] += out.z_loss.item()
            rec["tokens"].append([s.tokens_per_expert_E.tolist() for s in out.moe_stats])
            rec["dropped"].append([s.dropped.item() for s in out.moe_stats])
        rec["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        opt.step()
        opt.zero_grad()
        records.append(rec)
    records[-1]["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return records


@pytest.mark.parametrize("mode", ["capacity", "dropless"])
def test_recompute_equals_no_recompute_step_by_step(one_thread, mode):
    extra = [] if mode == "capacity" else ["model.moe.capacity_factor=null"]
    ref = _train("none", 3, 2, *extra)
    assert sum(sum(d) for r in ref for d in r["dropped"]) > 0 or mode == "dropless"  # capacity drops do happen
    for setting in ("full", "moe_experts", "mixers", "mlp"):
        got = _train(setting, 3, 2, *extra)
        for g, r in zip(got, ref):
            for key in ("loss", "grad_norm", "aux", "z", "tokens", "dropped"):
                assert g[key] == r[key], (setting, key)  # exact: recompute reorders nothing
        for name, p in ref[-1]["params"].items():
            assert torch.equal(got[-1]["params"][name], p), (setting, name)


def _saved_bytes(setting: str) -> int:
    """Bytes autograd saves through saved-tensor hooks in one forward: everything outside the recomputed regions
    (a non-reentrant checkpoint keeps its region's inputs itself and saves nothing of the interior)."""
    model, _ = _model(setting)
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens).logits.sum().backward()
    return total


def test_each_part_saves_less_and_full_saves_least(one_thread):
    saved = {s: _saved_bytes(s) for s in SETTINGS}
    for part in ("moe_experts", "mixers", "mlp"):
        assert saved[part] < saved["none"], (part, saved)
    assert saved["full"] < min(saved[p] for p in ("moe_experts", "mixers", "mlp")), saved
    assert saved["full"] < saved["none"] / 2, saved


def test_recompute_is_off_in_eval_and_under_no_grad():
    model, _ = _model("full")
    tokens = torch.randint(0, 256, (2, 16))
    ref, _ = _model("none")
    model.eval(), ref.eval()
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, ref(tokens).logits)


def test_checkpoint_parts_are_checked():
    with pytest.raises(ConfigError, match=r"^train.checkpoint_parts: expected a subset of"):
        load_config(None, ["train.activation_checkpointing=selective", 'train.checkpoint_parts=["router"]'])
    with pytest.raises(ConfigError, match=r"^train.checkpoint_parts: only used with"):
        load_config(None, ['train.checkpoint_parts=["mlp"]'])


@pytest.mark.parametrize("setting", ["full", "new_mixers"])
def test_recompute_of_mamba2_and_gdn_layers_equals_no_recompute(one_thread, setting):
    """Mamba-2 and Gated DeltaNet layers recompute under "full" and under their own parts, bitwise as without."""
    ref = _train("none", 2, 2, *EVERY_MIXER)
    got = _train(setting, 2, 2, *EVERY_MIXER)
    for r, g in zip(ref, got):
        assert g["loss"] == r["loss"] and g["grad_norm"] == r["grad_norm"] and g["tokens"] == r["tokens"]
    for name, p in ref[-1]["params"].items():
        assert torch.equal(got[-1]["params"][name], p), name
    model, _ = _model(setting, *EVERY_MIXER)
    wrapped = [type(b.mixer).__name__ for b in model.blocks if "forward" in vars(b.mixer)]
    assert sorted(wrapped) == (
        ["Attention", "GatedDeltaNet", "Mamba", "Mamba2"] if setting == "full" else ["GatedDeltaNet", "Mamba2"]
    )
