"""launch/train.py's command line, parsed without running anything."""

import importlib.util
from pathlib import Path


def test_repeated_set_flags_add_up():
    """`--set A --set B` keeps both (argparse's default would keep only the last flag's values)."""
    path = Path(__file__).resolve().parents[2] / "launch" / "train.py"
    spec = importlib.util.spec_from_file_location("train_script", path)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    args = train.parse_args(["--config", "c.json", "--set", "train.steps=3", "train.lr=0.1", "--set", "train.seed=7"])
    assert args.set == ["train.steps=3", "train.lr=0.1", "train.seed=7"]
