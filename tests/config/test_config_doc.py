"""docs/config.md is generated from moe_dist/config/schema.py and must stay in step with it."""

import dataclasses
import json
import typing
from dataclasses import dataclass

import pytest

from moe_dist.config import JobConfig
from moe_dist.config.doc import COMMAND, DOC_PATH, ConfigDocError, main, render


def _leaf_fields(cls: type, prefix: str = ""):
    """(dotted key, default) of every non-section field of the config tree."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaf_fields(hints[f.name], key + ".")
        else:
            yield key, f.default_factory() if f.default is dataclasses.MISSING else f.default


def test_committed_reference_is_current():
    assert DOC_PATH.is_file(), f"{DOC_PATH} is missing: generate it with `{COMMAND}`"
    assert DOC_PATH.read_text() == render(), f"{DOC_PATH} is stale: regenerate it with `{COMMAND}`"


def test_every_key_is_listed_with_its_default():
    lines = render().splitlines()
    keys = list(_leaf_fields(JobConfig))
    assert len(keys) > 50  # the walk itself found the tree
    for key, default in keys:
        row = [ln for ln in lines if ln.startswith(f"| `{key}` |")]
        assert len(row) == 1, f"{key}: expected one table row, found {len(row)}"
        assert f"| `{json.dumps(default)}` |" in row[0].replace("\\|", "|"), (
            f"{key}: default {default!r} not in {row[0]}"
        )
    assert render().count("\n| `") == len(keys)  # and no row for a key that does not exist


def test_field_without_comment_is_an_error_naming_the_key():
    @dataclass
    class Inner:
        documented: int = 1  # has a meaning
        bare: float = 0.5

    @dataclass
    class Root:
        inner: Inner = dataclasses.field(default_factory=Inner)  # a section

    with pytest.raises(ConfigDocError, match=r"^inner\.bare: config field has no trailing"):
        render(Root)


def test_multiline_field_comment_and_rendering():
    @dataclass
    class Section:
        choice: typing.Literal["a", "b"] = "a"  # picks | between a and b
        maybe: typing.Optional[int] = None  # optional count

    @dataclass
    class Root:
        sec: Section = dataclasses.field(default_factory=Section)  # the section

    text = render(Root)
    assert '| `sec.choice` | `"a" \\| "b"` | `"a"` | picks \\| between a and b |' in text
    assert "| `sec.maybe` | `int \\| null` | `null` | optional count |" in text


def test_check_flag(tmp_path, capsys):
    doc = tmp_path / "config.md"
    assert main(["--check"], path=doc) == 1  # missing
    doc.write_text(render().replace("| RMSNorm epsilon |", "| old text |"))
    assert main(["--check"], path=doc) == 1
    assert COMMAND in capsys.readouterr().err
    assert main(["--write"], path=doc) == 0
    assert main(["--check"], path=doc) == 0
    assert doc.read_text() == render()
