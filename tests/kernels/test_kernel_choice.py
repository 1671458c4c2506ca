"""The "auto" / "torch" / "triton" choice (moe_dist.layers.kernel_choice), made once for the device a layer is
built for, and the plain-PyTorch references.

Building for "cuda" needs no GPU: the model is built on the meta device, and the Triton kernel modules import
without one (no driver queries at import: this file imports them on machines without a GPU), so what "auto"
resolves to on CUDA is checked here too.
"""

import pytest
import torch
import torch.nn.functional as F
from moe_dist.kernels.reference import flash_attention_ref, permute_tokens_ref, unpermute_tokens_ref

import moe_dist.layers.kernel_choice as impl
from moe_dist.config import AttentionConfig, load_config
from moe_dist.layers.attention import Attention, attention_kernel
from moe_dist.layers.experts import grouped_mm_unfit
from moe_dist.layers.mamba import scan_kernel
from moe_dist.layers.permutation import Permutation, permute_rows, unpermute_rows
from moe_dist.layers.scan import selective_scan
from moe_dist.layers.sdpa import sdpa, sdpa_offset
from moe_dist.models.decoder import build_model


def torch_path(*args, **kwargs):
    return "torch"


def no_kernel():
    pytest.fail("a kernel was loaded")


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_what_auto_resolves_to_on_each_device(no_interpreter):
    """The decoder of configs/debug.json (attention, Mamba and MoE layers), built for CPU and for CUDA."""
    cfg = load_config("configs/debug.json").model
    assert build_model(cfg, "cpu").implementations() == {
        "attention": "sdpa",
        "scan": "torch",
        "permutation": "torch",
        "experts": "grouped_mm",
    }
    assert build_model(cfg, "cuda").implementations() == {
        "attention": "sdpa",
        "attention_documents": "triton",
        "scan": "triton",
        "permutation": "triton",
        "experts": "grouped_mm",
    }
    cfg.attention.impl = "triton"
    assert build_model(cfg, "cuda").implementations()["attention"] == "triton"
    cfg.attention.impl = cfg.mamba.impl = cfg.moe.impl = "torch"
    assert set(build_model(cfg, "cuda").implementations().values()) == {"sdpa", "torch", "grouped_mm"}


def test_the_chosen_functions_are_the_torch_paths_and_the_kernels(no_interpreter):
    from moe_dist.kernels.flash_attention import flash_attention
    from moe_dist.kernels.permute import permute_tokens, unpermute_tokens
    from moe_dist.kernels.selective_scan import selective_scan as triton_scan

    assert attention_kernel("triton", "cuda").fn is flash_attention
    assert scan_kernel("auto", "cuda").fn is triton_scan
    cpu_scan = scan_kernel("auto", "cpu", chunk_size=8)
    assert cpu_scan.fn.func is selective_scan and cpu_scan.fn.keywords == {"chunk_size": 8}
    assert Permutation.for_device("auto", "cuda") == Permutation(
        impl.Kernel("triton", permute_tokens), impl.Kernel("triton", unpermute_tokens)
    )
    assert Permutation.for_device("auto", "cpu") == Permutation(
        impl.Kernel("torch", permute_rows), impl.Kernel("torch", unpermute_rows)
    )


def test_a_kernel_is_called_as_its_function():
    k = impl.Kernel("torch", lambda x, y=1: x + y)
    assert k(1) == 2 and k(1, y=5) == 6


@pytest.mark.parametrize(
    "key, build",
    [
        ("model.attention.impl", lambda d: attention_kernel("triton", d)),
        ("model.mamba.impl", lambda d: scan_kernel("triton", d)),
        ("model.moe.impl", lambda d: Permutation.for_device("triton", d)),
    ],
)
def test_triton_for_a_device_it_cannot_use_is_a_one_line_error_naming_the_key(key, build, no_interpreter):
    for device, why in (("cpu", "built for the CPU (TRITON_INTERPRET=1"), ("meta", "built for meta")):
        with pytest.raises(ValueError) as err:
            build(device)
        msg = str(err.value)
        assert msg.startswith(f"{key}='triton': the Triton ") and why in msg and "\n" not in msg, msg


def test_triton_under_the_interpreter_takes_the_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert scan_kernel("triton", "cpu").name == "triton"
    assert scan_kernel("auto", "cpu").name == "torch"  # auto never picks the interpreter


def test_without_the_triton_package(monkeypatch):
    real_find_spec = impl.importlib.util.find_spec
    monkeypatch.setattr(
        impl.importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name, *a)
    )
    with pytest.raises(ValueError, match=r"^model\.mamba\.impl='triton': .*triton package is not installed$"):
        impl.resolve("triton", "model.mamba.impl", "cuda", torch_path, no_kernel, "scan")
    assert impl.resolve("auto", "model.mamba.impl", "cuda", torch_path, no_kernel, "scan") == impl.Kernel(
        "torch", torch_path
    )


@pytest.mark.parametrize("auto_on_cuda", ["torch", "triton"])
def test_auto_on_cpu_imports_no_kernel(auto_on_cuda):
    for key in ("model.attention.impl", "model.mamba.impl", "model.moe.impl"):
        got = impl.resolve("auto", key, "cpu", torch_path, no_kernel, "kernel", auto_on_cuda=auto_on_cuda)
        assert got == impl.Kernel("torch", torch_path)


def test_unknown_choice_names_the_key():
    with pytest.raises(ValueError, match=r"^model\.mamba\.impl: expected 'auto', 'torch' or 'triton', got 'cpu'$"):
        scan_kernel("cpu", "cpu")
    with pytest.raises(ValueError, match=r"^model\.attention\.impl: expected 'auto', 'torch' or 'triton', got 'cuda'$"):
        attention_kernel("cuda")


# ------------------------------------------------------------------------------------------------ attention masks

SDPA, OURS = impl.AttentionPath("sdpa"), impl.AttentionPath("triton")
NO_TRITON = "the triton package is not installed"


def slow_kinds(choice: dict) -> dict:
    return {kind: path.slow for kind, path in choice.items() if path.slow is not None}


def test_mask_kind_of_a_call():
    kind = impl.attention_mask_kind
    assert kind(False, False, False) == "causal"
    assert kind(True, False, False) == "documents"
    assert kind(True, True, False) == "prefix"
    assert kind(False, False, True) == kind(True, False, True) == kind(True, True, True) == "window"


def test_what_auto_takes_on_cuda_for_each_mask_kind():
    """With the Triton kernel available: SDPA's own kernels for causal attention, ours for documents and prefix-LM,
    SDPA's explicit mask for a sliding window (the one slow path, with its reason)."""
    choice = impl.attention_choice("auto", torch.device("cuda"), 64, None)
    assert {k: p.name for k, p in choice.items()} == {
        "causal": "sdpa",
        "documents": "triton",
        "prefix": "triton",
        "window": "sdpa",
    }
    assert choice["causal"] == SDPA and choice["documents"] == choice["prefix"] == OURS
    assert slow_kinds(choice) == {
        "window": "attention with a sliding window shorter than the sequence takes SDPA with an explicit mask "
        "(no fast kernel here takes a sliding window)"
    }


@pytest.mark.parametrize(
    "why_no_triton, head_dim, reason",
    [
        (NO_TRITON, 64, f"the Triton kernel cannot run: {NO_TRITON}"),
        (None, 256, "the Triton kernel cannot run: head_dim 256 is outside 16..128"),
        (None, 8, "the Triton kernel cannot run: head_dim 8 is outside 16..128"),
    ],
)
def test_auto_on_cuda_where_ours_cannot_run_takes_sdpa_and_says_why(why_no_triton, head_dim, reason):
    choice = impl.attention_choice("auto", "cuda", head_dim, why_no_triton)
    assert {p.name for p in choice.values()} == {"sdpa"}
    slow = slow_kinds(choice)
    assert set(slow) == {"documents", "prefix", "window"}
    assert slow["documents"] == f"attention with documents takes SDPA with an explicit mask ({reason})"
    assert slow["prefix"] == f"attention with prefix-LM takes SDPA with an explicit mask ({reason})"


def test_torch_and_triton_on_cuda():
    torch_choice = impl.attention_choice("torch", "cuda", 64, None)
    assert {p.name for p in torch_choice.values()} == {"sdpa"}
    assert "(model.attention.impl='torch')" in torch_choice["documents"].slow
    assert set(slow_kinds(torch_choice)) == {"documents", "prefix", "window"}
    triton_choice = impl.attention_choice("triton", "cuda", 64, None)
    assert triton_choice == {"causal": OURS, "documents": OURS, "prefix": OURS, "window": triton_choice["window"]}
    assert triton_choice["window"].name == "sdpa" and triton_choice["window"].slow


def test_off_cuda_every_kind_takes_sdpa_and_nothing_is_called_slow():
    for device in ("cpu", "meta"):
        for why in (None, NO_TRITON, "the model is built for the CPU"):
            for impl_name in ("auto", "torch"):
                assert impl.attention_choice(impl_name, device, 64, why) == dict.fromkeys(impl.ATTENTION_MASKS, SDPA)
    # "triton" under the interpreter: ours where it takes the mask
    assert impl.attention_choice("triton", "cpu", 64, None) == {
        "causal": OURS,
        "documents": OURS,
        "prefix": OURS,
        "window": SDPA,
    }


@pytest.mark.parametrize("impl_name", ["auto", "torch", "triton"])
@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("why_no_triton", [None, NO_TRITON])
@pytest.mark.parametrize("head_dim", [8, 16, 64, 128, 256])
def test_ours_is_never_chosen_where_it_cannot_take_the_mask(impl_name, device, why_no_triton, head_dim):
    """No choice sends a sliding window, a head size outside 16..128 or a missing triton to our kernel: each
    choice is one ours takes, or "triton" is a one-line error naming the key."""
    try:
        choice = impl.attention_choice(impl_name, device, head_dim, why_no_triton)
    except ValueError as e:
        assert impl_name == "triton" and (why_no_triton is not None or not 16 <= head_dim <= 128)
        assert str(e).startswith("model.attention.impl='triton': the Triton flash-attention kernel is not available")
        assert "\n" not in str(e)
        return
    assert choice["window"].name == "sdpa"
    if any(p.name == "triton" for p in choice.values()):
        assert why_no_triton is None and 16 <= head_dim <= 128


def test_what_context_parallel_attention_takes_for_each_mask_kind():
    """Under CP, causal pieces (queries at an offset) take what documents take: ours on CUDA with "auto" where it
    runs, else SDPA with an explicit mask, slow on CUDA with its reason; the other kinds are as without CP."""
    auto = impl.attention_cp_choice("auto", "cuda", 64, None)
    assert auto == {"causal": OURS, "documents": OURS, "prefix": OURS, "window": auto["window"]}
    assert auto["window"].name == "sdpa" and "under context parallelism" in auto["window"].slow
    assert impl.attention_cp_choice("triton", "cpu", 64, None) == {
        "causal": OURS,
        "documents": OURS,
        "prefix": OURS,
        "window": SDPA,
    }
    for why, head_dim in ((NO_TRITON, 64), (None, 256)):
        slow = impl.attention_cp_choice("auto", "cuda", head_dim, why)
        assert {p.name for p in slow.values()} == {"sdpa"} and set(slow_kinds(slow)) == set(impl.ATTENTION_MASKS)
        assert slow["causal"].slow.startswith(
            "attention with a causal mask under context parallelism takes SDPA with an explicit mask (the Triton"
        )
    torch_cuda = impl.attention_cp_choice("torch", "cuda", 64, None)
    assert "(model.attention.impl='torch')" in torch_cuda["causal"].slow
    for device in ("cpu", "meta"):
        for impl_name in ("auto", "torch"):
            assert impl.attention_cp_choice(impl_name, device, 64, None) == dict.fromkeys(impl.ATTENTION_MASKS, SDPA)
    with pytest.raises(ValueError, match="model.attention.impl='triton': the Triton flash-attention kernel is not"):
        impl.attention_cp_choice("triton", "cuda", 256, None)


def test_the_layer_takes_the_kernel_of_each_mask_kind(no_interpreter):
    """The Attention layer built for CUDA: ours for documents and prefix-LM, SDPA for causal and windows."""
    from moe_dist.kernels.flash_attention import flash_attention

    cfg = AttentionConfig(n_heads=4, n_kv_heads=2, mask="prefix", sliding_window=16)
    layer = Attention(64, cfg, init_std=0.02, n_layers=2, device="cuda")
    fns = {kind: k.fn for kind, k in layer.kernels.items()}
    assert fns == {"causal": sdpa, "documents": flash_attention, "prefix": flash_attention, "window": sdpa}
    assert layer.implementations == {
        "attention": "sdpa",
        "attention_documents": "triton",
        "attention_prefix": "triton",
    }
    cpu = Attention(64, cfg, init_std=0.02, n_layers=2, device="cpu")
    assert {k.fn for k in cpu.kernels.values()} == {sdpa} and cpu.implementations == {"attention": "sdpa"}
    # the context-parallel path: ours (with a query offset) for causal, documents and prefix; SDPA for windows
    assert {kind: k.name for kind, k in layer.cp_kernels.items()} == {
        "causal": "triton",
        "documents": "triton",
        "prefix": "triton",
        "window": "torch",
    }
    assert layer.cp_kernels["window"].fn is sdpa_offset
    assert {k.fn for k in cpu.cp_kernels.values()} == {sdpa_offset}


def test_grouped_gemm_fallbacks_on_cuda():
    """Why the experts would leave torch's grouped GEMM, from the probe (F.grouped_mm present) and the config."""
    bf16, f32 = torch.bfloat16, torch.float32
    assert grouped_mm_unfit("cuda", True, bf16, (64, 256, 128)) is None
    assert (
        grouped_mm_unfit("cuda", False, bf16, (64,))
        == f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
    )
    assert grouped_mm_unfit("cuda", True, f32, (64,)) == "its cuda kernel takes bfloat16, not float32"
    assert grouped_mm_unfit("cuda", True, bf16, (64, 12, 6)) == "widths [6, 12] are not multiples of 16 bytes"
    assert grouped_mm_unfit("cpu", True, f32, (64, 12)) is None  # 48-byte fp32 rows
    assert grouped_mm_unfit("cpu", True, torch.float64, (64,)) == (
        "its cpu kernel takes float32, bfloat16, float16, not float64"
    )


# ------------------------------------------------------------------------------------------------ references


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq, hkv, seq", [(4, 4, 1), (4, 2, 7), (6, 1, 33)])
def test_flash_attention_ref_is_sdpa(hq, hkv, seq, causal):
    q, k, v = (torch.randn(2, h, seq, 16, dtype=torch.float64) for h in (hq, hkv, hkv))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
    torch.testing.assert_close(flash_attention_ref(q, k, v, causal=causal), want, rtol=1e-12, atol=1e-12)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv, scale=0.3)
    torch.testing.assert_close(flash_attention_ref(q, k, v, causal, 0.3), want, rtol=1e-12, atol=1e-12)


def test_flash_attention_ref_keeps_dtype_and_computes_in_fp32():
    q = torch.randn(1, 2, 5, 16).bfloat16()
    out = flash_attention_ref(q, q[:, :1], q[:, :1])
    assert out.dtype == torch.bfloat16
    want = flash_attention_ref(q.float(), q[:, :1].float(), q[:, :1].float()).bfloat16()
    assert torch.equal(out, want)


def test_permutation_refs_by_explicit_loops():
    T, K, D = 5, 2, 3
    x_TD = torch.randn(T, D, dtype=torch.float64)
    rows_R = torch.tensor([7, 0, 3, 9, 1])  # assignments a = k·T + t, dropped ones absent
    weight_A = torch.rand(K * T, dtype=torch.float64)
    x_RD = permute_tokens_ref(x_TD, rows_R, K)
    for r, a in enumerate(rows_R.tolist()):
        assert torch.equal(x_RD[r], x_TD[a % T])
    y_RD = torch.randn(len(rows_R), D, dtype=torch.float64)
    want = torch.zeros(T, D, dtype=torch.float64)
    for r, a in enumerate(rows_R.tolist()):
        want[a % T] += weight_A[a] * y_RD[r]
    torch.testing.assert_close(unpermute_tokens_ref(y_RD, rows_R, weight_A, T), want, rtol=1e-14, atol=1e-14)


# ------------------------------------------------------------------------------------------------ fla-core kernels


@pytest.fixture(params=[True, False], ids=["fla", "no_fla"])
def fla_installed(request, monkeypatch):
    """Whether fla-core is importable, as kernel_choice's probe sees it (the loaders import fla only when called)."""
    real_find_spec = impl.importlib.util.find_spec

    def find_spec(name, *args):
        if name == "fla":
            return real_find_spec("moe_dist") if request.param else None
        return real_find_spec(name, *args)

    monkeypatch.setattr(impl.importlib.util, "find_spec", find_spec)
    return request.param


def _fla_layers():
    from moe_dist.layers.fla_ops import fla_gated_delta_rule, fla_ssd_scan
    from moe_dist.layers.gdn import delta_rule_kernel
    from moe_dist.layers.mamba2 import scan_kernel as ssd_kernel

    return [
        ("model.mamba2.impl", "SSD scan", lambda i, d, n=16: ssd_kernel(i, d, d_state=n), fla_ssd_scan),
        (
            "model.gdn.impl",
            "gated delta rule",
            lambda i, d, n=16: delta_rule_kernel(i, d, head_k_dim=n),
            fla_gated_delta_rule,
        ),
    ]


def test_auto_takes_fla_on_cuda_where_it_is_installed(fla_installed, no_interpreter):
    for key, what, build, kernel in _fla_layers():
        cpu = build("auto", "cpu")
        assert cpu.name == "torch" and cpu.slow is None and cpu.fn.func is build("torch", "cpu").fn.func
        chosen = build("auto", "cuda")
        if fla_installed:
            assert chosen == impl.Kernel("triton", kernel) and build("triton", "cuda").fn is kernel
            continue
        why = "the fla-core package is not installed: pip install 'moe_dist[fla]'"
        assert chosen.name == "torch" and chosen.slow == f"the {what} takes the PyTorch path ({why})"
        with pytest.raises(ValueError) as err:
            build("triton", "cuda")
        assert str(err.value) == f"{key}='triton': the Triton {what} is not available: {why}"


@pytest.mark.parametrize("fla_installed", [True], indirect=True)
def test_key_sizes_fla_cannot_take(fla_installed, no_interpreter):
    for key, what, build, _ in _fla_layers():
        size_key = {"model.mamba2.impl": "model.mamba2.d_state", "model.gdn.impl": "model.gdn.head_k_dim"}[key]
        why = f"{size_key}=512 is above 256, the largest the fla kernels take"
        with pytest.raises(ValueError, match=rf"^{key}='triton': the Triton {what} is not available: {why}$"):
            build("triton", "cuda", 512)
        assert build("auto", "cuda", 512).slow == f"the {what} takes the PyTorch path ({why})"
        assert build("auto", "cuda", 256).name == "triton"


def test_the_decoder_reports_ssd_and_delta_rule_and_start_up_warns(fla_installed, no_interpreter):
    from moe_dist.train.startup import slow_paths

    cfg = load_config("configs/debug.json")
    cfg.model.layers = ["attention+moe", "mamba2+moe", "gdn+mlp"]
    cfg.model.n_layers = 3
    model = build_model(cfg.model, "cuda")
    choice = "triton" if fla_installed else "torch"
    assert {k: v for k, v in model.implementations().items() if k in ("ssd", "delta_rule")} == {
        "ssd": choice,
        "delta_rule": choice,
    }
    warned = [line for line in slow_paths(cfg, model, torch.device("cuda")) if "PyTorch path" in line]
    assert len(warned) == (0 if fla_installed else 2), warned
