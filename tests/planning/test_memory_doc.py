"""docs/memory.md's planned figures against the plan `launch/train.py --dry-run` prints for the same config, world
size and settings (`memory_plan`, called in-process as the dry-run calls it: nothing is spawned). Each table row
names its config, GPUs and layout; what the text around a table fixes for all its rows (ZeRO 2, the sequence
length, the device) is each test's `settings`. A figure must equal the plan's to the precision it is printed with.
Measured columns are not checked here: they come from runs (benchmarks/studies/memory_check.py)."""

import re
from functools import cache
from pathlib import Path

import pytest

from moe_dist.config import load_config
from moe_dist.planning.capacity import H200_MIB, MIB
from moe_dist.planning.memory import memory_plan

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs/memory.md"


def doc_tables() -> dict[str, list[list[dict[str, str]]]]:
    """Heading -> the tables under it, in order, each a list of rows {column header: cell}."""
    sections: dict[str, list] = {}
    heading, header, rows = "", None, []
    for line in [*DOC.read_text().splitlines(), ""]:
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header = cells
            elif not set("".join(cells)) <= set("-: "):
                rows.append(dict(zip(header, cells)))
        elif header is not None:
            sections.setdefault(heading, []).append(rows)
            header, rows = None, []
    return sections


TABLES = doc_tables()


def table(heading: str, index: int = 0) -> list[dict[str, str]]:
    rows = TABLES[heading][index]
    assert rows, heading
    return rows


def layout_settings(layout: str) -> tuple[dict[str, int], list[str]]:
    """A layout cell ("dp 2 · tp 4 · ep 2 · SP (one node)", "pp 4, pp_virtual 2") -> its dimensions and the --set
    overrides that give it; a dimension it does not name is 1, and no "SP" means no sequence parallelism."""
    dims = {k: int(v) for k, v in re.findall(r"\b(dp|cp|tp|ep|pp|pp_virtual)\s+(\d+)", layout)}
    sets = [f"parallel.{k}={dims.get(k, 1)}" for k in ("tp", "ep", "cp", "pp", "pp_virtual")]
    sp = re.search(r"\bSP\b", layout) is not None
    sets.append(f"parallel.sequence_parallel={str(sp).lower()}")
    return dims, sets


@cache
def plan(config: str, world: int, sets: tuple[str, ...], device: str = "cuda", pp_rank: int | None = None) -> dict:
    """The dry-run's plan against an H200, as the tables are (without a GPU the dry-run plans for one; with one it
    would read that GPU's memory)."""
    cfg = load_config(REPO / f"configs/{config}.json", list(sets))
    return memory_plan(cfg, world, device, capacity_bytes=H200_MIB * MIB, pp_rank=pp_rank)


def mismatch(cell: str, value: float | bool) -> str | None:
    """None when `cell` ("**142.7**", "+5.9", "131,072", "yes", "1.07 GB") is `value` to the precision printed."""
    text = cell.replace("*", "").replace(",", "").replace("GB", "").strip()
    if isinstance(value, bool):
        return None if text.lower() == ("yes" if value else "no") else f"{cell} != {value}"
    decimals = len(text.split(".")[1]) if "." in text else 0
    if abs(float(text) - value) <= 0.5 * 10**-decimals + 1e-9:
        return None
    return f"{cell} != {value:.{decimals + 2}f}"


def compare(row: dict[str, str], figures: dict[str, float | bool]) -> list[str]:
    """The row's cells that differ from the plan's `figures` (column header -> value), as "column: doc != plan"."""
    out = []
    for column, value in figures.items():
        wrong = mismatch(row[column], value)
        if wrong:
            out.append(f"{column}: {wrong}")
    return out


def config_of(row: dict[str, str]) -> str:
    return row["config"].strip("`")


def per_rank(p: dict) -> dict[str, float | bool]:
    mem, cap = p["memory_per_rank_gb"], p["capacity"]
    figures = {k: mem[k] for k in ("params", "grads", "optimizer", "activations", "transient", "runtime", "total")}
    return {**figures, "headroom": cap["headroom_gb"], "fits": cap["fits"]}


def check_rows(rows: list[dict[str, str]], settings, figures) -> None:
    """For each row: its layout with `settings(row)` planned at its GPUs; `figures(row, plan)` against the row."""
    wrong = []
    for row in rows:
        dims, sets = layout_settings(row["layout"])
        p = plan(config_of(row), int(row["GPUs"]), tuple(sets + settings(row)))
        assert p["layout"]["dp"] == dims["dp"], row
        wrong += [f"{config_of(row)} {row['GPUs']} {row['layout']}: {w}" for w in compare(row, figures(row, p))]
    assert not wrong, "docs/memory.md disagrees with the dry-run:\n" + "\n".join(wrong)


def test_shipped_big_configs_zero2_table():
    """The table under "The shipped big configs on H200s": ZeRO 2, recompute per row, CUDA."""
    rows = table("The shipped big configs on H200s")

    def figures(row, p):
        return {**per_rank(p), "expert rows ×": p["layout"]["expert_rows_factor"]}

    check_rows(rows, lambda r: ["deepspeed.zero_stage=2", f"train.activation_checkpointing={r['recompute']}"], figures)


def test_zero1_against_zero2_table():
    rows = table("One reduction per step (ZeRO 1) against ZeRO 2")
    wrong = []
    for row in rows:
        _, sets = layout_settings(row["layout"])
        one, two = (plan(config_of(row), int(row["GPUs"]), (*sets, f"deepspeed.zero_stage={z}")) for z in (1, 2))
        figures = {
            "ZeRO 1: grads": one["memory_per_rank_gb"]["grads"],
            "ZeRO 1: total": one["memory_per_rank_gb"]["total"],
            "ZeRO 1 fits": one["capacity"]["fits"],
            "ZeRO 2: grads": two["memory_per_rank_gb"]["grads"],
            "ZeRO 2: total": two["memory_per_rank_gb"]["total"],
        }
        wrong += [f"{config_of(row)} {row['GPUs']} {row['layout']}: {w}" for w in compare(row, figures)]
    assert not wrong, "docs/memory.md disagrees with the dry-run:\n" + "\n".join(wrong)


def test_qwen_table():
    rows = table("Qwen3-Next-80B and Qwen3.5-35B on H200s")
    no_headroom = lambda r, p: {k: v for k, v in per_rank(p).items() if k != "headroom"}  # noqa: E731
    check_rows(rows, lambda r: ["deepspeed.zero_stage=2"], no_headroom)


def test_long_context_table():
    """One sequence of 128k or 256k tokens per micro-batch, ZeRO 2; "per token" in KB (10³ bytes) per local token."""
    rows = table("Long context: Jamba and Nemotron 3 at 128k and 256k tokens (context parallelism)")
    seq = {"128k": 131072, "256k": 262144}

    def figures(row, p):
        tokens = seq[row["S"]] // p["layout"]["cp"]
        return {
            **per_rank(p),
            "T per rank": tokens,
            "per token (KB)": p["memory_per_rank_gb"]["activations"] * 1e9 / tokens / 1e3,
            "expert rows ×": p["layout"]["expert_rows_factor"],
        }

    check_rows(rows, lambda r: [f"train.seq_len={seq[r['S']]}", "deepspeed.zero_stage=2"], figures)


def test_pipeline_table():
    """Mixtral 8x7B at 64 GPUs as shipped (ZeRO 1, ep 8, full recompute) with `parallel.pp` (and pp_virtual)."""
    rows = table("Pipeline stages (`parallel.pp`, `parallel.pp_virtual`)")
    wrong = []
    for row in rows:
        dims, _ = layout_settings(row["layout"])
        sets = (f"parallel.pp={dims.get('pp', 1)}", f"parallel.pp_virtual={dims.get('pp_virtual', 1)}")
        whole = plan("mixtral_8x7b", 64, sets)
        totals = (
            whole["pipeline"]["total_gb_by_pp_rank"] if "pipeline" in whole else [whole["memory_per_rank_gb"]["total"]]
        )
        first = plan("mixtral_8x7b", 64, sets, pp_rank=0) if "pipeline" in whole else whole
        mem = first["memory_per_rank_gb"]
        cells = row["rank 0: params / grads / optimizer / activations GB"].split("/")
        doc_totals = row["total per pipeline rank GB"].split(",")
        assert len(doc_totals) == len(totals), row
        pairs = [
            *zip(cells, (mem[k] for k in ("params", "grads", "optimizer", "activations"))),
            *zip(doc_totals, totals),
        ]
        wrong += [f"{row['layout']}: {w}" for cell, value in pairs if (w := mismatch(cell, value))]
    assert not wrong, "docs/memory.md disagrees with the dry-run:\n" + "\n".join(wrong)


def test_cpu_planned_against_measured_table():
    """The default job at 1024 tokens × 1 per micro-batch, 4 per step, fp32, planned for CPU ranks."""
    rows = table("Planned against measured (CPU)")
    base = ["train.seq_len=1024", "train.micro_batch_size=1", "train.global_batch_size=4", "train.steps=2"]
    wrong = []
    for row in rows:
        dims, sets = layout_settings(row["layout"].split(",")[0])
        zero = re.search(r"ZeRO (\d)", row["layout"]).group(1)
        recompute = f"train.activation_checkpointing={row['recompute']}"
        p = plan("mixtral_small", int(row["ranks"]), (*sets, *base, f"deepspeed.zero_stage={zero}", recompute), "cpu")
        assert p["layout"]["dp"] == dims["dp"], row
        mem = p["memory_per_rank_gb"]
        figures = {"planned without runtime": mem["total"] - mem["runtime"], "runtime": mem["runtime"]}
        figures["planned total"] = mem["total"]
        wrong += [f"{row['ranks']} {row['layout']} {row['recompute']}: {w}" for w in compare(row, figures)]
    assert not wrong, "docs/memory.md disagrees with the dry-run:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "setting, sets",
    [
        ("`none`", []),
        (
            '`selective` `["moe_experts"]`',
            ["train.activation_checkpointing=selective", 'train.checkpoint_parts=["moe_experts"]'],
        ),
        ("`full`", ["train.activation_checkpointing=full"]),
    ],
)
def test_activation_checkpointing_table(setting, sets):
    """The default job at 2048 tokens × 2, one process, fp32: the plan's activations + grads per setting."""
    rows = {r["setting"]: r for r in table("Activation checkpointing", 1)}
    p = plan("mixtral_small", 1, ("train.seq_len=2048", "train.micro_batch_size=2", *sets), "cpu")
    mem = p["memory_per_rank_gb"]
    assert mismatch(rows[setting]["planned activations + grads"], mem["activations"] + mem["grads"]) is None


# "Qwen3-235B-A22B on H200s": each layout cell as --set overrides of the shipped config (pp 8 · tp 4 + SP · ep 8 of
# whole experts, ZeRO 1, ρ 3); the cells describe rows relative to one another, so they are spelled out here.
QWEN3_235B = {
    "pp 8 · tp 2 + SP · ep 4, ZeRO 2 (the previous attempt)": [
        "parallel.tp=2",
        "parallel.ep=4",
        "parallel.etp=null",
        "deepspeed.zero_stage=2",
        "plan.expert_imbalance=2",
    ],
    "pp 8 · tp 2 + SP · ep 4, ZeRO 2": [
        "parallel.tp=2",
        "parallel.ep=4",
        "parallel.etp=null",
        "deepspeed.zero_stage=2",
    ],
    "pp 8 · tp 4 + SP · ep 8 (etp 1), ZeRO 1 (shipped)": [],
    "the same, ZeRO 2": ["deepspeed.zero_stage=2"],
    "the same, pp_virtual 2": ["parallel.pp_virtual=2"],
    "the same, no sequence parallelism": ["parallel.sequence_parallel=false"],
    "the same, ρ at the routing bound (8)": ["plan.expert_imbalance=null"],
    "pp 1 · tp 4 · cp 4 · ep 16, ZeRO 1 (no pipeline)": [
        "parallel.pp=1",
        "parallel.cp=4",
        "parallel.ep=16",
        "parallel.sequence_parallel=false",
        "parallel.etp=null",
    ],
}


def test_qwen3_235b_table():
    """Pipeline rank 0 (the one with the most micro-batches in flight) of each layout."""
    rows = table("Qwen3-235B-A22B on H200s")
    assert {r["layout"] for r in rows} == set(QWEN3_235B)
    wrong = []
    for row in rows:
        sets = tuple(QWEN3_235B[row["layout"]])
        p = plan("qwen3_235b_a22b", int(row["GPUs"]), sets, pp_rank=0)
        figures = {k: v for k, v in per_rank(p).items() if k != "transient"}
        figures["expert rows ×"] = p["layout"]["expert_rows_factor"]
        figures["fits"] = p["capacity"]["fits"]
        cells = {**row, "fits": row["fits"].split(" ")[0]}  # "yes (no room)"
        wrong += [f"{row['layout']} {row['GPUs']}: {w}" for w in compare(cells, figures)]
    assert not wrong, "docs/memory.md disagrees with the dry-run:\n" + "\n".join(wrong)
