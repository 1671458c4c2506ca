"""What every sequence mixer kind (attention, MLA, Mamba-1, Mamba-2, Gated DeltaNet) must do the same way, one test per
property over the kinds: causality, built on meta then materialized and initialized, init deterministic in the
seed, backward reaching every parameter, packed documents equal to separate runs, cached decoding equal to the
full forward, the kernel choice on the CPU. Each kind's builders and its own checks live in its test file
(test_attention.py, test_mla.py, test_mamba.py, test_mamba2.py, test_gdn.py); a new mixer kind in the registry fails
`test_every_mixer_kind_is_covered` until it is added here."""

from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from layers import test_attention as attention_tests
from layers import test_gdn as gdn_tests
from layers import test_mamba as mamba1_tests
from layers import test_mamba2 as mamba2_tests
from layers import test_mla as mla_tests

from moe_dist.config import AttentionConfig, GDNConfig, Mamba2Config, MambaConfig
from moe_dist.layers import registry
from moe_dist.layers.attention import Attention
from moe_dist.layers.gdn import GatedDeltaNet
from moe_dist.layers.mamba import Mamba
from moe_dist.layers.mamba2 import Mamba2
from moe_dist.layers.mla import MLA, MLAConfig

F64 = torch.float64


@dataclass
class Kind:
    """One mixer kind's builders and what differs between kinds in the shared checks."""

    d_model: int  # of `layer`
    layer: Callable[[], torch.nn.Module]  # fp64, with random values everywhere (no wiring hides behind 0 or 1)
    meta: Callable[[], torch.nn.Module]  # built on the meta device, as the trainer builds it
    check_init: Callable[[torch.nn.Module], None]  # the kind's init values after init_weights
    with_impl: Callable[[str], torch.nn.Module]  # the layer with `impl` = auto | torch | triton
    auto: dict  # what impl="auto" takes on the CPU (`implementations`)
    no_triton: str  # how impl="triton" is refused off a GPU, naming the key
    meta_d_model: Optional[int] = None  # of `meta`, where it differs
    causal_atol: float = 1e-14  # how far earlier outputs may move when a later input changes
    reach: float = 1e-8  # how far every later output must move
    seeded: Optional[Callable[[int], torch.nn.Module]] = None  # built and initialized from a seed
    seed_sensitive: tuple[str, ...] = ()  # parameters a different seed must change
    backward_layer: Optional[Callable[[], torch.nn.Module]] = None  # default: `layer`
    backward_ids: Optional[list[list[int]]] = None  # document ids of the backward check (None: one document)
    documents: tuple[int, tuple[int, ...]] = (2, (5, 1, 8, 4))  # batch, document lengths of a packed row
    cache: Optional[tuple[int, int, int]] = None  # sequence length, prompt, last call's length (None: no cache)
    state: Callable = lambda state: state.ssm  # the recurrent state of a cache
    check_state: Callable = lambda layer, state: None


def _mamba1_init(layer):
    d_inner = layer.d_inner
    torch.testing.assert_close(-torch.exp(layer.A_log), -torch.arange(1.0, 9.0).expand(d_inner, -1))
    torch.testing.assert_close(layer.D, torch.ones(d_inner))
    dt = F.softplus(layer.dt_proj.bias)
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    assert dt.std() > 0  # sampled per channel, not a constant
    assert layer.dt_proj.weight.abs().max() <= 3**-0.5
    assert 0.01 < layer.in_proj.weight.std() < 0.03  # init_std = 0.02
    for norm in (layer.dt_norm, layer.b_norm, layer.c_norm):
        torch.testing.assert_close(norm.weight, torch.ones_like(norm.weight))
    assert torch.count_nonzero(layer.conv1d.bias) == 0


def _mamba2_init(layer):
    A = torch.exp(layer.A_log)
    assert A.min() >= 1 and A.max() <= 16 and A.std() > 0
    torch.testing.assert_close(layer.D, torch.ones(8))
    torch.testing.assert_close(layer.norm.weight, torch.ones(32))
    dt = F.softplus(layer.dt_bias)
    assert dt.min() >= 0.01 * (1 - 1e-5) and dt.max() <= 0.05 * (1 + 1e-5) and dt.std() > 0
    assert 0.01 < layer.in_proj.weight.std() < 0.03  # init_std = 0.02
    assert torch.count_nonzero(layer.conv1d.bias) == 0


def _gdn_init(layer):
    A = torch.exp(layer.A_log)
    assert A.min() >= 0.01 * (1 - 1e-5) and A.max() <= 16 * (1 + 1e-5)
    dt = F.softplus(layer.dt_bias)
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5) and dt.std() > 0
    torch.testing.assert_close(layer.norm.weight, torch.ones_like(layer.norm.weight))
    assert 0.01 < layer.in_proj_qkvz.weight.std() < 0.03  # init_std = 0.02


def _attention_init(layer):
    assert layer.wq.weight.shape == (32, 32) and layer.wk.weight.shape == (16, 32) and layer.wo.weight.shape == (32, 32)
    assert 0.015 < layer.wq.weight.std() < 0.025
    assert 0.007 < layer.wo.weight.std() < 0.013  # init_std / sqrt(2 * n_layers) = 0.01


def _mla_init(layer):
    assert layer.wq_b.weight.shape == (3 * 10, 7) and layer.wkv_a.weight.shape == (10 + 4, 24)
    assert layer.wkv_b.weight.shape == (3 * (6 + 5), 10) and layer.wo.weight.shape == (24, 3 * 5)
    assert 0.01 < torch.cat([layer.wq_a.weight.flatten(), layer.wkv_b.weight.flatten()]).std() < 0.03
    for norm in (layer.q_norm, layer.kv_norm):
        torch.testing.assert_close(norm.weight, torch.ones_like(norm.weight))


def _mamba2_state(layer, state):
    assert state.conv.shape == (2, layer.conv_dim, 3)


def _gdn_state(layer, state):
    assert state.recurrent.dtype == F64  # fp64 activations: the state is at least as wide


M1, M2, GDN = mamba1_tests, mamba2_tests, gdn_tests
KINDS = {
    "attention": Kind(
        d_model=attention_tests.D_MODEL,
        layer=lambda: attention_tests.build(n_heads=4, n_kv_heads=2),
        meta=lambda: Attention(32, AttentionConfig(n_heads=4, n_kv_heads=2), init_std=0.02, n_layers=2),
        check_init=_attention_init,
        with_impl=lambda impl: attention_tests.build(n_heads=4, n_kv_heads=2, impl=impl),
        auto={"attention": "sdpa"},
        no_triton=r"^model\.attention\.impl='triton': the Triton flash-attention kernel is not available: ",
        meta_d_model=32,
        causal_atol=1e-12,
        reach=1e-6,
        backward_ids=[[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 2, 2]],
    ),
    "mla": Kind(
        d_model=mla_tests.D_MODEL,
        layer=lambda: mla_tests.build(q_lora_rank=7, rope_interleave=True, rope_scaling=mla_tests.YARN),
        meta=lambda: MLA(mla_tests.D_MODEL, MLAConfig(**mla_tests.SHAPES, q_lora_rank=7), init_std=0.02, n_layers=2),
        check_init=_mla_init,
        with_impl=lambda impl: mla_tests.build(impl=impl),
        auto={"mla": "sdpa"},
        no_triton=r"^model\.mla\.impl='triton': there is no Triton MLA attention kernel yet",
        causal_atol=1e-12,
        reach=1e-6,
        backward_ids=[[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 2, 2]],
    ),
    "mamba1": Kind(
        d_model=M1.D_MODEL,
        layer=lambda: M1.randomize(M1.build(inner_norms=True)),
        meta=lambda: Mamba(
            M1.D_MODEL, MambaConfig(d_state=8, dt_rank=3, inner_norms=True), norm_eps=M1.EPS, init_std=0.02
        ),
        check_init=_mamba1_init,
        with_impl=lambda impl: M1.build(impl=impl),
        auto={"scan": "torch"},
        no_triton=r"^model\.mamba\.impl='triton': the Triton selective scan is not available: ",
        seeded=lambda seed: M1.build(seed=seed),
        seed_sensitive=("in_proj.weight", "dt_proj.bias"),
        backward_layer=lambda: M1.build(inner_norms=True, proj_bias=True),
        cache=(13, 6, 2),
    ),
    "mamba2": Kind(
        d_model=M2.D_MODEL,
        layer=lambda: M2.randomize(M2.build()),
        meta=lambda: Mamba2(
            M2.D_MODEL, Mamba2Config(**M2.SHAPE, dt_min=0.01, dt_max=0.05), norm_eps=M2.EPS, init_std=0.02
        ),
        check_init=_mamba2_init,
        with_impl=lambda impl: M2.build(impl=impl),
        auto={"ssd": "torch"},
        no_triton=r"^model\.mamba2\.impl='triton': the Triton SSD scan is not available: ",
        seeded=lambda seed: M2.build(seed=seed),
        seed_sensitive=("dt_bias", "A_log"),
        backward_layer=lambda: M2.randomize(M2.build(proj_bias=True)),
        backward_ids=[[0] * 4 + [1] * 6] * 2,
        documents=(2, (5, 11, 3)),  # the cuts fall mid-chunk (chunk_size 8) and inside the conv window
        cache=(15, 9, 2),
        check_state=_mamba2_state,
    ),
    "gdn": Kind(
        d_model=GDN.D_MODEL,
        layer=lambda: GDN.randomize(GDN.build()),
        meta=lambda: GatedDeltaNet(GDN.D_MODEL, GDNConfig(**GDN.SHAPES), norm_eps=GDN.EPS, init_std=0.02),
        check_init=_gdn_init,
        with_impl=lambda impl: GDN.build(impl=impl),
        auto={"delta_rule": "torch"},
        no_triton=r"^model\.gdn\.impl='triton': the Triton gated delta rule is not available: ",
        seeded=lambda seed: GDN.build(seed=seed),
        seed_sensitive=("A_log", "dt_bias"),
        backward_ids=[[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 2, 2]],
        documents=(1, (5, 1, 8, 4)),  # a one-position document too
        cache=(13, 6, 0),
        state=lambda state: state.recurrent,
        check_state=_gdn_state,
    ),
}


def kinds(has=None):
    return [k for k, spec in KINDS.items() if has is None or getattr(spec, has) is not None]


def test_every_mixer_kind_is_covered():
    assert set(KINDS) == {k.name for k in registry.kinds("mixer")}


@pytest.mark.parametrize("kind", kinds())
def test_causal(kind):
    spec = KINDS[kind]
    layer = spec.layer()
    x = torch.randn(2, 13, spec.d_model, dtype=F64)
    t = 6
    x2 = x.clone()
    x2[:, t] += torch.randn(2, spec.d_model, dtype=F64)
    out, out2 = layer(x), layer(x2)
    torch.testing.assert_close(out2[:, :t], out[:, :t], rtol=0, atol=spec.causal_atol)
    assert (out2[:, t:] - out[:, t:]).abs().amax(dim=-1).min() > spec.reach  # the change reaches every later position


@pytest.mark.parametrize("kind", kinds())
def test_meta_build_then_init(kind):
    """Built on meta (no memory), materialized on CPU and initialized from the global RNG, as the trainer does."""
    spec = KINDS[kind]
    with torch.device("meta"):
        layer = spec.meta()
    assert all(p.is_meta for p in layer.parameters())
    layer.to_empty(device="cpu")
    torch.manual_seed(0)
    layer.init_weights()
    spec.check_init(layer)
    d_model = spec.meta_d_model or spec.d_model
    out = layer(torch.randn(2, 9, d_model))
    assert out.shape == (2, 9, d_model) and torch.isfinite(out).all()


@pytest.mark.parametrize("kind", kinds("seeded"))
def test_init_is_deterministic_in_the_seed(kind):
    """Every rank materializes its own copy: the same seed must give the same weights, another seed others."""
    spec = KINDS[kind]
    a, b, c = spec.seeded(0), spec.seeded(0), spec.seeded(1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)
    params_a, params_c = dict(a.named_parameters()), dict(c.named_parameters())
    for name in spec.seed_sensitive:
        assert not torch.equal(params_a[name], params_c[name]), name


@pytest.mark.parametrize("kind", kinds())
def test_backward_reaches_every_parameter(kind):
    spec = KINDS[kind]
    layer = (spec.backward_layer or spec.layer)()
    ids = None if spec.backward_ids is None else torch.tensor(spec.backward_ids)
    x = torch.randn(2, 7 if ids is None else ids.shape[1], spec.d_model, dtype=F64)
    layer(x, document_ids=ids).square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("kind", kinds())
def test_packed_documents_equal_separate_runs(kind):
    """With document_ids, each document of a packed row (attention mask; conv window and recurrent state) equals
    the layer run on it alone."""
    spec = KINDS[kind]
    layer = spec.layer()
    batch, lengths = spec.documents
    docs = [torch.randn(batch, n, spec.d_model, dtype=F64) for n in lengths]
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(batch, -1)
    packed = layer(torch.cat(docs, 1), document_ids=ids)
    separate = torch.cat([layer(d) for d in docs], 1)
    torch.testing.assert_close(packed, separate, rtol=1e-10, atol=1e-12)
    assert (layer(torch.cat(docs, 1)) - separate).abs().max() > 1e-6  # without masking the documents mix


@pytest.mark.parametrize("kind", kinds("cache"))
def test_cached_decoding_equals_full_forward(kind):
    """Generation: a prompt through the cache, then one position per call (and a last call of several, where the
    kind lists one), equal the full forward's outputs at those positions; the recurrent state stays fp32 under
    bf16 activations."""
    spec = KINDS[kind]
    seqlen, prompt, last = spec.cache
    layer = spec.layer()
    x = torch.randn(2, seqlen, spec.d_model, dtype=F64)
    state = layer.new_state(2, x.device, x.dtype)
    spec.check_state(layer, state)
    outs = [layer(x[:, :prompt], state)]
    outs += [layer(x[:, t : t + 1], state) for t in range(prompt, seqlen - last)]
    if last:
        outs.append(layer(x[:, seqlen - last :], state))
    torch.testing.assert_close(torch.cat(outs, 1), layer(x), rtol=1e-10, atol=1e-12)
    spec.check_state(layer, state)
    assert spec.state(layer.new_state(1, x.device, torch.bfloat16)).dtype == torch.float32


@pytest.mark.parametrize("kind", kinds())
def test_impl_choice(kind):
    """On the CPU, "auto" takes the PyTorch path, "torch" builds, and "triton" is refused with the key's name."""
    spec = KINDS[kind]
    assert spec.with_impl("auto").implementations == spec.auto
    spec.with_impl("torch")
    with pytest.raises(ValueError, match=spec.no_triton):
        spec.with_impl("triton")
