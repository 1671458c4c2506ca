"""TensorBoard pictures of expert load, drawn with numpy and PIL (training never imports matplotlib).

Two kinds, both on one viridis scale with a colour bar:
- `expert_load_images`: per step, (MoE layers × experts) token share and drop rate;
- `history_image`: per MoE layer, (experts × recent logged steps) token share, the view that stays readable
  at 128-512 experts, where one scalar line per expert is a single-coloured tangle.

Cells shrink with the number of rows or columns so that an image stays within a few thousand pixels (at 512
experts an expert is 2 pixels wide or tall), and axis labels thin out to every k-th index so that they never
overlap. At up to `WIDE // CELL` columns every cell is CELL × CELL pixels and every index is labelled.
"""

from __future__ import annotations

from collections import deque

import numpy as np

CELL = 24  # pixels per cell, the largest size
MIN_CELL = 2  # the smallest: a 512-expert axis is 1,024 pixels
TITLE_H, AXIS_H, LABEL_W, BAR_W = 20, 16, 28, 52  # margins: title, column indices, row indices, colour bar
MIN_W = 200  # room for the title
WIDE, TALL = 1536, 1024  # pixel budgets of the expert axis: along x in the layer heatmap, along y in the history
HISTORY_BUDGET = 768  # pixel budget of the steps axis of a history image
CHAR_W, CHAR_H = 6, 11  # PIL's default bitmap font
# viridis at 9 evenly spaced points: perceptually uniform and readable by colour-blind viewers
_VIRIDIS = np.array(
    [
        [68, 1, 84],
        [71, 44, 122],
        [59, 81, 139],
        [44, 113, 142],
        [33, 144, 141],
        [39, 173, 129],
        [92, 200, 99],
        [170, 220, 50],
        [253, 231, 37],
    ],
    dtype=np.float64,
)


def colormap(values: np.ndarray) -> np.ndarray:
    """Values in [0, 1] (clipped) → viridis RGB uint8, shape values.shape + (3,)."""
    x = np.clip(np.nan_to_num(values), 0.0, 1.0) * (len(_VIRIDIS) - 1)
    lo = np.minimum(np.floor(x).astype(int), len(_VIRIDIS) - 2)
    frac = (x - lo)[..., None]
    return np.round(_VIRIDIS[lo] * (1 - frac) + _VIRIDIS[lo + 1] * frac).astype(np.uint8)


def cell_px(n: int, budget: int) -> int:
    """Pixels per cell along an axis of n cells: CELL while n cells fit the budget, never below MIN_CELL."""
    return max(MIN_CELL, min(CELL, budget // max(n, 1)))


def label_every(cell: int, label_px: int) -> int:
    """The smallest k in 1, 2, 5, 10, 20, 50, ... with k cells at least as long as one label plus a gap."""
    need = (label_px + 4) / cell
    k = 1
    while k < need:
        k = k * 5 // 2 if str(k).startswith("2") else k * 2
    return k


def _grid_size(n_rows: int, n_cols: int, cell_h: int, cell_w: int) -> tuple[int, int]:
    return TITLE_H + n_rows * cell_h + AXIS_H, max(LABEL_W + n_cols * cell_w + BAR_W, MIN_W)


def _grid_image(values_RC: np.ndarray, vmax: float, title: str, cell_h: int, cell_w: int, col_names) -> np.ndarray:
    """RGB image (H, W, 3) uint8 of a (rows, cols) matrix on the 0..vmax viridis scale: row indices on the left,
    `col_names[c]` below every labelled column, a colour bar with its range on the right."""
    from PIL import Image, ImageDraw

    R, C = values_RC.shape
    H, W = _grid_size(R, C, cell_h, cell_w)
    img = np.full((H, W, 3), 255, dtype=np.uint8)
    cells = colormap(values_RC / vmax if vmax > 0 else np.zeros_like(values_RC))  # (R, C, 3)
    img[TITLE_H : TITLE_H + R * cell_h, LABEL_W : LABEL_W + C * cell_w] = cells.repeat(cell_h, 0).repeat(cell_w, 1)
    bar_x, bar_h = LABEL_W + C * cell_w + 6, R * cell_h
    ramp = colormap(np.linspace(1.0, 0.0, bar_h))[:, None, :]  # top = vmax
    img[TITLE_H : TITLE_H + bar_h, bar_x : bar_x + 8] = ramp
    pil = Image.fromarray(img)
    draw = ImageDraw.Draw(pil)
    draw.text((4, 4), title, fill=(0, 0, 0))
    k_rows = label_every(cell_h, CHAR_H)
    for r in range(0, R, k_rows):
        draw.text((4, TITLE_H + r * cell_h + max(cell_h // 2 - 5, 0)), str(r), fill=(0, 0, 0))
    k_cols = label_every(cell_w, CHAR_W * max(len(str(n)) for n in col_names))
    pad = min(4, cell_w // 2)
    for c in range(0, C, k_cols):
        draw.text((LABEL_W + c * cell_w + pad, TITLE_H + R * cell_h + 2), str(col_names[c]), fill=(0, 0, 0))
    draw.text((bar_x + 11, TITLE_H), f"{vmax:.2g}", fill=(0, 0, 0))
    draw.text((bar_x + 11, TITLE_H + bar_h - 11), "0", fill=(0, 0, 0))
    return np.asarray(pil)


# ------------------------------------------------------------------------------- (layers × experts) per step


def heatmap_cells(n_experts: int) -> tuple[int, int]:
    """(cell height, cell width) of `heatmap_image` for n_experts columns."""
    return CELL, cell_px(n_experts, WIDE)


def heatmap_size(n_rows: int, n_cols: int) -> tuple[int, int]:
    """(height, width) in pixels of `heatmap_image` for a (n_rows, n_cols) matrix."""
    return _grid_size(n_rows, n_cols, *heatmap_cells(n_cols))


def heatmap_image(values_LE: np.ndarray, vmax: float, title: str) -> np.ndarray:
    """A (layers, experts) matrix as an RGB image (H, W, 3) uint8 (`heatmap_cells` pixels per value)."""
    return _grid_image(values_LE, vmax, title, *heatmap_cells(values_LE.shape[1]), list(range(values_LE.shape[1])))


def share_scale(share: np.ndarray, n_experts: int) -> float:
    """Token-share colour range 0..max(2/E, max share): a balanced router sits mid-scale."""
    return max(2.0 / n_experts, float(np.nanmax(share)) if share.size else 0.0)


def expert_load_images(layers: list[dict], step: int) -> dict[str, np.ndarray]:
    """The two per-step pictures of a record's MoE layers: token share and drop rate, (layers, experts) each."""
    tpe = np.array([layer["tokens_per_expert"] for layer in layers], dtype=np.float64)  # (L, E)
    dpe = np.array([layer.get("dropped_per_expert", [0] * tpe.shape[1]) for layer in layers], dtype=np.float64)
    share = tpe / np.maximum(tpe.sum(axis=1, keepdims=True), 1.0)
    drop_rate = dpe / np.maximum(tpe, 1.0)
    return {
        "moe/expert_load": heatmap_image(
            share, share_scale(share, tpe.shape[1]), f"token share (layer x expert) @{step}"
        ),
        "moe/drop_rate": heatmap_image(drop_rate, 1.0, f"drop rate (layer x expert) @{step}"),
    }


# ------------------------------------------------------------------------------- (experts × steps) per layer


def history_cells(n_experts: int, n_steps: int) -> tuple[int, int]:
    """(cell height, cell width) of `history_image`: experts down, steps across."""
    return cell_px(n_experts, TALL), cell_px(n_steps, HISTORY_BUDGET)


def history_size(n_experts: int, n_steps: int) -> tuple[int, int]:
    return _grid_size(n_experts, n_steps, *history_cells(n_experts, n_steps))


def history_image(share_ET: np.ndarray, steps: list[int], title: str) -> np.ndarray:
    """One MoE layer's token share as (experts, logged steps), oldest step on the left."""
    E, T = share_ET.shape
    return _grid_image(share_ET, share_scale(share_ET, E), title, *history_cells(E, T), list(steps))


class LoadHistory:
    """Per MoE layer, the token share of each expert at the last `keep` logged steps (not checkpointed: after a
    resume the history starts again)."""

    def __init__(self, keep: int):
        self.keep = keep
        self.layers: list[deque] = []

    def observe(self, layers: list[dict], step: int) -> None:
        if len(self.layers) != len(layers):
            self.layers = [deque(maxlen=self.keep) for _ in layers]
        for ring, layer in zip(self.layers, layers, strict=True):
            tpe = np.asarray(layer["tokens_per_expert"], dtype=np.float64)
            ring.append((step, tpe / max(tpe.sum(), 1.0)))

    def images(self) -> dict[str, np.ndarray]:
        out = {}
        for i, ring in enumerate(self.layers):
            steps = [s for s, _ in ring]
            share_ET = np.stack([v for _, v in ring], axis=1)
            span = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
            out[f"moe/layer{i}/load_history"] = history_image(
                share_ET, steps, f"layer {i}: token share (expert x step), {span}"
            )
        return out
