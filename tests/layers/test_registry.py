"""The layer-kind registry: a new mixer is its own module and description plus one registry entry, and every part
of the system that asks about layers (config checks, the decoder, recompute, inference caches, tensor parallelism,
the memory plan, the performance model, the pipeline cut) takes it without naming it.

The kind added here is deliberately trivial: a token-wise gated projection, `y = wo(silu(wi x))`, with an O(1)
inference state (the count of positions seen), a FLOP term of its own, and no tensor-parallel rule or shard-aware
forward, so the refusals for what it lacks are exercised too."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_dist.config import ConfigError, load_config
from moe_dist.layers import registry
from moe_dist.layers.kind import LayerKind
from moe_dist.models.activation_checkpointing import apply_activation_checkpointing
from moe_dist.models.decoder import build_model, check_context_parallel, generate, materialize_whole
from moe_dist.planning.memory import activation_bytes
from moe_dist.planning.stage_cut import layer_costs
from moe_dist.planning.workload import model_cost

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")


class Gate(nn.Module):
    def __init__(self, d_model: int, std: float):
        super().__init__()
        self.wi = nn.Linear(d_model, 2 * d_model, bias=False)
        self.wo = nn.Linear(2 * d_model, d_model, bias=False)
        self.std = std
        self.calls = 0  # forwards run (a recompute runs one more)

    def init_weights(self) -> None:
        for lin in (self.wi, self.wo):
            nn.init.normal_(lin.weight, std=self.std)

    def forward(self, x, cache=None, document_ids=None, prefix=None):
        self.calls += 1
        if cache is not None:
            cache["seen"] += x.shape[1]
        return self.wo(F.silu(self.wi(x)))


def _per_token_flops(m, S: int) -> float:
    return 1000.0 + S  # a term of its own, to find in the cost model


GATE = LayerKind(
    name="gate",
    config=None,  # no section of its own: it reads the model's keys
    role="mixer",
    module=Gate,
    build=lambda m, device: Gate(m.d_model, m.init_std),
    part="gate",
    new_state=lambda module, batch, max_len, device, dtype: {"seen": 0},
    flops_per_token=_per_token_flops,
    activation_bytes=lambda cfg, tp, cp, a: 4 * cfg.model.d_model * a,
)


@pytest.fixture
def gate_kind(monkeypatch):
    """The one registry entry a new kind needs (layers/registry.py's KINDS)."""
    monkeypatch.setitem(registry.KINDS, "gate", GATE)


def _cfg(*overrides):
    base = ["model.n_layers=2", "model.mixer_pattern=A", "model.ffn_pattern=E", "model.moe.capacity_factor=null"]
    base.append('model.layers=["gate+moe","attention+mlp"]')
    return load_config(REPO / "configs/debug.json", base + list(overrides))


def test_unknown_kind_is_one_line_listing_the_known(gate_kind):
    with pytest.raises(ConfigError, match=r"^model\.layers\[0\]: expected a mixer \(.*gate.*\)") as e:
        _cfg('model.layers=["nope+moe","attention+mlp"]')
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^unknown layer kind 'nope': known kinds are attention, .*, gate$"):
        registry.kind("nope")


def test_a_registered_kind_builds_trains_decodes_and_is_recomputed(gate_kind):
    cfg = _cfg("train.activation_checkpointing=selective", 'train.checkpoint_parts=["gate"]').model
    model = materialize_whole(build_model(cfg), "cpu", seed=0)
    gate = model.blocks[0].mixer
    assert isinstance(gate, Gate) and registry.kind_of(gate) is GATE
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    ref = model(tokens).logits
    apply_activation_checkpointing(model, _cfg("train.activation_checkpointing=full").train)
    gate.calls = 0
    model(tokens).logits.float().sum().backward()
    assert gate.calls == 2  # its forward, then its recompute in the backward
    assert gate.wi.weight.grad is not None and gate.wi.weight.grad.abs().sum() > 0
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, ref)
    cache = model.new_cache(2, 12)
    assert cache.layers[0] == {"seen": 0}  # the kind's own inference state
    model.eval()
    cached = generate(model, tokens[:, :4], 4, temperature=0, use_cache=True)
    again = generate(model, tokens[:, :4], 4, temperature=0, use_cache=False)
    assert torch.equal(cached, again)


def test_what_a_kind_lacks_is_refused_in_one_line(gate_kind):
    with pytest.raises(ConfigError, match=r"^model\.layers: gate layers do not support tensor parallelism yet"):
        _cfg("parallel.tp=2")
    cfg = _cfg()
    with pytest.raises(ConfigError, match=r"^parallel\.cp: 2 needs context-parallel support .*; gate has none"):
        check_context_parallel(cfg.model, 2)


def test_the_plans_take_the_kind_from_its_description(gate_kind):
    cfg = _cfg("train.seq_len=64")
    cost = model_cost(cfg)
    assert cost.layers == {"gate": 1, "attention": 1, "moe": 1, "mlp": 1}
    without = dataclasses.replace(GATE, flops_per_token=lambda m, S: 0.0)
    registry.KINDS["gate"] = without
    assert cost.fwd_flops_per_token - model_cost(cfg).fwd_flops_per_token == pytest.approx(1000.0 + 64)
    costs, _ = layer_costs(cfg)
    registry.KINDS["gate"] = GATE
    assert layer_costs(cfg)[0][0] - costs[0] == pytest.approx(1000.0 + 64)
    act = activation_bytes(cfg)
    d, a, tokens = cfg.model.d_model, 4, cfg.train.micro_batch_size * cfg.train.seq_len
    norm_full = 3 * d * a + 4
    assert act["gate"] == pytest.approx((norm_full + 4 * d * a) * tokens)


def _library_files():
    return [p for p in (REPO / "moe_dist").rglob("*.py") if "hf" not in p.parts]


@pytest.mark.parametrize("name", ["mamba2", "gdn", "mamba1"])
def test_no_library_file_outside_its_home_names_a_recurrent_kind(name):
    """Outside its layer file, the registry and the Hugging Face mappers, no code names the kind: not its layer
    name as a string, not its module or config classes, not its config section (`model.<section>` reads)."""
    kind = registry.kind(name)
    home = REPO / "moe_dist" / "layers" / f"{kind.module.__module__.rsplit('.', 1)[1]}.py"
    names = {kind.name, kind.module.__name__, f"{kind.module.__name__}State", kind.section, kind.config.__name__}
    stem = home.stem
    found = []
    for path in _library_files():
        if path in (home, REPO / "moe_dist/layers/registry.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            hit = (isinstance(node, ast.Constant) and node.value in names) or (
                isinstance(node, (ast.Name, ast.alias)) and getattr(node, "id", getattr(node, "name", "")) in names
            )
            hit = hit or (isinstance(node, ast.Attribute) and node.attr == kind.section)
            hit = hit or (isinstance(node, ast.ImportFrom) and (node.module or "").rsplit(".", 1)[-1] == stem)
            if hit:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"{name} is named outside its home: {found}"


def test_the_prefix_mask_is_passed_where_a_placed_kind_reads_it(gate_kind):
    """`ModelConfig.prefix_lm`: the trainer builds the prefix-LM mask only for a model with a layer that reads it."""
    prefix = ["model.attention.mask=prefix", "data.document_masking=true"]
    assert _cfg(*prefix).model.prefix_lm()
    assert not _cfg().model.prefix_lm()
    mamba_only = ["model.n_layers=1", 'model.layers=["mamba1+moe"]']
    assert not _cfg(*prefix, *mamba_only).model.prefix_lm()  # the attention section's mask, but no attention layer
