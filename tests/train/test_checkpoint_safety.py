"""Checkpoint verification, fallback and pruning without a training run: checkpoints are built here in the
training format (safetensors + meta.json with sha256), then damaged the ways disks and attackers do."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moe_dist.parallel.mesh import Mesh
from moe_dist.train.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    complete_checkpoints,
    latest_checkpoint,
    prune_checkpoints,
    select_checkpoint,
    verify_checkpoint,
)
from moe_dist.train.checkpoint.read import _sha256

MESH = Mesh(
    rank=0,
    world_size=1,
    local_rank=0,
    local_world_size=1,
    device=torch.device("cpu"),
    dp=1,
    dp_rank=0,
    ep=1,
    ep_rank=0,
    ep_group=None,
    edp_group=None,
    ep_group_name="ep_size_1",
)


def _write_checkpoint(root: Path, step: int) -> Path:
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    tensors = {"w": torch.full((4, 3), float(step)), "exp_avg.w": torch.zeros(4, 3), "exp_avg_sq.w": torch.ones(4, 3)}
    save_file(tensors, str(d / "rank00000.safetensors"))
    _write_meta(d, step)
    return d


def _write_meta(d: Path, step: int, files: dict | None = None) -> None:
    files = files or {f.name: _sha256(f) for f in sorted(d.glob("*.safetensors"))}
    meta = {"format": FORMAT_VERSION, "step": step, "adam_step": step, "lr": 1e-3, "files": files}
    (d / "meta.json").write_text(json.dumps(meta))


class _Payload:
    """Unpickling this runs `touch <sentinel>`: the shape of a real pickle exploit."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


def _flip_byte(f: Path, offset: int) -> None:
    data = bytearray(f.read_bytes())
    data[offset] ^= 0x01
    f.write_bytes(bytes(data))


def test_verify_accepts_a_sound_checkpoint_and_indexes_shapes(tmp_path):
    d = _write_checkpoint(tmp_path, 3)
    meta, index = verify_checkpoint(d)
    assert meta["step"] == 3
    assert index["w"] == (d / "rank00000.safetensors", (4, 3))


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "delete"])
def test_verify_names_the_damaged_file(tmp_path, damage):
    d = _write_checkpoint(tmp_path, 3)
    f = d / "rank00000.safetensors"
    if damage == "flip_byte":
        _flip_byte(f, f.stat().st_size - 5)  # inside tensor data: the header still parses, the hash does not match
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    else:
        f.unlink()
    with pytest.raises(CheckpointError, match=str(f)):
        verify_checkpoint(d)


def test_a_pickle_in_place_of_a_tensor_file_is_rejected_and_never_runs(tmp_path):
    sentinel = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(sentinel))
    # The payload is live: unpickling it in another process creates its sentinel.
    probe = tmp_path / "probe_pwned"
    subprocess.run(
        [sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
        input=pickle.dumps(_Payload(probe)),
        check=True,
        cwd=Path(__file__).parent,
    )
    assert probe.exists()

    d = _write_checkpoint(tmp_path / "ckpt", 3)
    f = d / "rank00000.safetensors"
    f.write_bytes(payload)
    _write_meta(d, 3)  # the attacker also fixed the sha256: only the format stops it
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        verify_checkpoint(d)
    torch_file = d / "model.pt"  # a torch.save pickle listed in the manifest is never opened
    torch.save({"x": _Payload(sentinel)}, torch_file)
    _write_meta(d, 3, {"model.pt": _sha256(torch_file)})
    with pytest.raises(CheckpointError, match="refusing to open"):
        verify_checkpoint(d)
    _write_meta(d, 3, {"../../outside.safetensors": "0" * 64})  # nor a path outside the checkpoint
    with pytest.raises(CheckpointError, match="refusing to open"):
        verify_checkpoint(d)
    assert not sentinel.exists()


@pytest.mark.parametrize("meta_text", ["{not json", "[1, 2]", '{"format": 1, "step": "3"}', "\x80\x04pickle"])
def test_a_broken_manifest_is_an_error_naming_meta_json(tmp_path, meta_text):
    d = _write_checkpoint(tmp_path, 3)
    (d / "meta.json").write_text(meta_text, errors="surrogateescape")
    with pytest.raises(CheckpointError, match="meta.json"):
        verify_checkpoint(d)


def test_select_falls_back_past_each_bad_checkpoint_with_one_warning_each(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        _write_checkpoint(root, step)
    _flip_byte(root / "step_8" / "rank00000.safetensors", -5)
    f6 = root / "step_6" / "rank00000.safetensors"
    f6.write_bytes(f6.read_bytes()[:100])
    (root / ".step_10.tmp").mkdir()  # an interrupted save: never a candidate
    (root / ".step_10.tmp" / "meta.json").write_text("{}")
    (root / "step_12").mkdir()  # no manifest: incomplete
    warnings = []
    path, meta, _ = select_checkpoint(root, MESH, warnings.append)
    assert path == root / "step_4" and meta["step"] == 4
    assert len(warnings) == 2
    assert "step_8" in warnings[0] and str(root / "step_8" / "rank00000.safetensors") in warnings[0]
    assert "step_6" in warnings[1] and str(f6) in warnings[1]
    assert all("\n" not in w for w in warnings)


def test_select_starts_fresh_without_checkpoints_but_refuses_when_all_are_bad(tmp_path):
    root = tmp_path / "checkpoints"
    assert select_checkpoint(root, MESH, print) is None  # no directory at all
    root.mkdir()
    assert select_checkpoint(root, MESH, print) is None
    d = _write_checkpoint(root, 2)
    (d / "rank00000.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        select_checkpoint(root, MESH, lambda line: None)
    assert (d / "meta.json").exists()  # nothing deleted


def test_prune_keeps_the_newest_and_never_the_only_complete_one(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        _write_checkpoint(root, step)
    (root / ".step_5.tmp").mkdir()  # leftover of a killed save
    (root / ".step_0.deleting").mkdir()  # leftover of a killed prune
    removed = prune_checkpoints(root, keep_last=2, current=4)
    assert [p.name for p in removed] == ["step_2", "step_1"]
    assert sorted(p.name for p in root.iterdir()) == ["step_3", "step_4"]
    assert prune_checkpoints(root, keep_last=1, current=4) == [root / "step_3"]
    assert prune_checkpoints(root, keep_last=1, current=4) == []  # the only complete checkpoint stays
    assert [s for s, _ in complete_checkpoints(root)] == [4]
    assert prune_checkpoints(root, keep_last=0, current=4) == []  # 0 keeps everything


def test_prune_ignores_checkpoints_after_the_current_step(tmp_path):
    """After resume fell back from a corrupted step_8 to step_4, saving step_5 must not delete step_5's only
    predecessor in favour of the corrupted later one."""
    root = tmp_path / "checkpoints"
    for step in (4, 5, 8):
        _write_checkpoint(root, step)
    assert prune_checkpoints(root, keep_last=1, current=5) == [root / "step_4"]
    assert sorted(p.name for p in root.iterdir()) == ["step_5", "step_8"]


def test_latest_checkpoint_tolerates_a_corrupt_manifest(tmp_path):
    root = tmp_path / "checkpoints"
    _write_checkpoint(root, 2)
    (_write_checkpoint(root, 10) / "meta.json").write_text("{garbage")
    assert latest_checkpoint(root) == root / "step_10"  # unverified by design; resume verifies
    assert [s for s, _ in complete_checkpoints(root)] == [10, 2]


def test_a_file_from_another_run_is_rejected_before_use(tmp_path):
    """Same step, same names and shapes, a sound safetensors file: only the manifest's sha256 tells them apart."""
    ours, theirs = _write_checkpoint(tmp_path / "ours", 3), _write_checkpoint(tmp_path / "theirs", 3)
    other = theirs / "rank00000.safetensors"
    save_file({"w": torch.full((4, 3), -1.0), "exp_avg.w": torch.zeros(4, 3), "exp_avg_sq.w": torch.ones(4, 3)}, other)
    (ours / "rank00000.safetensors").write_bytes(other.read_bytes())
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        verify_checkpoint(ours)


def test_the_manifest_index_is_used_and_checked_against_each_header(tmp_path):
    """meta.json's "tensors" index (written by the trainer) spares a rank opening every file; the rank that
    hashes a file also checks the file's header against the index."""
    d = _write_checkpoint(tmp_path, 3)
    meta = json.loads((d / "meta.json").read_text())
    f = "rank00000.safetensors"
    meta["tensors"] = {n: [f, [4, 3]] for n in ("w", "exp_avg.w", "exp_avg_sq.w")}
    (d / "meta.json").write_text(json.dumps(meta))
    _, index = verify_checkpoint(d)
    assert index == {n: (d / f, (4, 3)) for n in meta["tensors"]}
    _, index = verify_checkpoint(d, rank=1, world_size=2)  # this rank hashes nothing: it trusts the index
    assert index["w"] == (d / f, (4, 3))
    meta["tensors"]["w"] = [f, [3, 4]]  # the index disagrees with the (intact, hash-matching) file
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="differ from those meta.json lists"):
        verify_checkpoint(d)
    meta["tensors"]["w"] = ["rank00001.safetensors", [4, 3]]  # a file the manifest does not list
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="'tensors' must map"):
        verify_checkpoint(d)
