"""MegaBlocks expert backend (`model.moe.backend = "megablocks"`): the expert GEMMs run on MegaBlocks' grouped GEMM.

Only the expert computation changes: routing, capacity, drops, aux/z losses and the dispatcher stay ours, so their
semantics (docs/moe_recipes.md) hold unchanged and the parameters (w13 = [w1 | w3]: (E, D, 2F); w2: (E, F, D)),
checkpoints and expert parallelism are those of the native backend. MegaBlocks' `dMoE` layer is not used: its
router, load-balancing loss and dropless-only dispatch have other semantics. MegaBlocks needs CUDA (and pins its own
torch), so this backend is chosen explicitly and refused with a one-line error where it cannot run.

Shape legend as in moe.py (experts.py chooses this backend): R routed rows sorted by expert, D d_model, F expert
hidden size, E experts.
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_dist.config.errors import ConfigError
from moe_dist.layers.mlp import gated_silu


def megablocks_unavailable() -> Optional[str]:
    """Why the MegaBlocks backend cannot run here, or None when it can."""
    try:
        from megablocks import grouped_gemm_util as gg
    except Exception as e:  # ImportError, or a megablocks built against another torch failing at import
        return f"megablocks does not import ({type(e).__name__}: {' '.join(str(e).split())})"
    if not gg.grouped_gemm_is_available():
        return "megablocks is installed without its grouped_gemm package"
    if not torch.cuda.is_available():
        return "no CUDA device (MegaBlocks' kernels are CUDA-only)"
    return None


def check_megablocks() -> None:
    """Raise the ConfigError naming the config key where the MegaBlocks backend cannot run."""
    why = megablocks_unavailable()
    if why is not None:
        raise ConfigError(f"model.moe.backend='megablocks': not usable here: {why}; use 'native'")


def megablocks_swiglu(
    x_RD: torch.Tensor, w13_ED2F: torch.Tensor, w2_EFD: torch.Tensor, rows_per_expert_E: torch.Tensor
) -> torch.Tensor:
    """SwiGLU experts over expert-sorted rows with MegaBlocks' grouped GEMM (`grouped_gemm.ops.gmm`, autograd
    included): (R, D) → (R, D), bf16 on CUDA. gmm(a, b, sizes) multiplies row group e of a by b[e]."""
    from megablocks.grouped_gemm_util import ops

    gmm = ops.gmm
    sizes_E = rows_per_expert_E.to("cpu", torch.int64)  # grouped_gemm takes the group sizes on the host
    return gmm(gated_silu(gmm(x_RD, w13_ED2F, sizes_E)), w2_EFD, sizes_E)
