"""Generate docs/config.md, the reference of every config key, from the dataclasses in moe_dist/config/schema.py.

    python -m moe_dist.config.doc            # print the markdown
    python -m moe_dist.config.doc --write    # write docs/config.md
    python -m moe_dist.config.doc --check    # exit 1 if docs/config.md differs from what would be written

Each key's meaning is the trailing `# comment` of its field, read from the source, so the reference cannot
drift from the code and is never written twice. A field without one is an error naming its dotted key.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, Literal

from moe_dist.config.schema import JobConfig

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "config.md"
COMMAND = "python -m moe_dist.config.doc --write"


class ConfigDocError(ValueError):
    """A config field the generator cannot document; the message is one line naming the dotted key."""


def field_comments(cls: type) -> dict[str, str]:
    """{field name: its trailing comment} for a dataclass, base classes first so a subclass's comment wins."""
    comments: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        # A field made in code (ModelConfig's layer-kind sections) carries its line in its metadata.
        comments.update({f.name: f.metadata["doc"] for f in dataclasses.fields(klass) if "doc" in f.metadata})
        try:
            # dedent: a class defined inside a function (as in the tests) has indented source; line numbers keep.
            src = textwrap.dedent(inspect.getsource(klass))
        except OSError:  # made by dataclasses.make_dataclass: no class statement to read
            continue
        by_line = {
            tok.start[0]: tok.string.lstrip("#").strip()
            for tok in tokenize.generate_tokens(io.StringIO(src).readline)
            if tok.type == tokenize.COMMENT
        }
        for node in ast.parse(src).body[0].body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                # A field written over several lines carries its comment on any of them.
                text = " ".join(by_line[n] for n in range(node.lineno, node.end_lineno + 1) if by_line.get(n))
                if text:
                    comments[node.target.id] = text
    return comments


def type_name(tp: Any) -> str:
    """An annotation as a user writes the value in JSON: `int | null`, `"auto" | "torch"`, `list[str]`, `object`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return " | ".join(json.dumps(c) for c in typing.get_args(tp))
    if origin is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    if tp is dict or origin is dict:
        return "object"
    return "null" if tp is type(None) else tp.__name__


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a bare pipe would end the table cell, even inside a code span


def _sections(cls: type, path: str, note: str) -> list[str]:
    """Markdown for the section `path` (a table of its plain keys), then its sub-sections in field order."""
    comments, hints = field_comments(cls), typing.get_type_hints(cls)
    rows, subsections = [], []
    for f in dataclasses.fields(cls):
        key = f"{path}.{f.name}" if path else f.name
        if f.name not in comments:
            raise ConfigDocError(
                f"{key}: config field has no trailing '# comment' "
                f"(in {cls.__module__}.{cls.__qualname__}); every key must say what it means"
            )
        if dataclasses.is_dataclass(hints[f.name]):
            subsections += _sections(hints[f.name], key, comments[f.name])
        else:
            rows.append(
                f"| `{key}` | `{_cell(type_name(hints[f.name]))}` | `{_cell(json.dumps(_default(f)))}` "
                f"| {_cell(comments[f.name])} |"
            )
    if not rows:  # a section holding only sections (the root) gets no empty table
        return subsections
    return [
        f"## `{path}`",
        "",
        f"{note[0].upper()}{note[1:]}.",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
        *rows,
        "",
        *subsections,
    ]


def render(root: type = JobConfig) -> str:
    """The whole reference page for the config tree rooted at `root`."""
    header = [
        "# Configuration reference",
        "",
        "Generated from the field comments in `moe_dist/config/schema.py` and in the layer files' sections",
        f"by `{COMMAND}`; do not edit by hand (tests/config/test_config_doc.py fails when this page is stale).",
        'Keys go in the JSON config under their section (`{"model": {"moe": {"top_k": 1}}}`) or on the command',
        "line as dotted overrides (`--set model.moe.top_k=1`); unknown keys and wrong types are errors.",
        "",
    ]
    return "\n".join(header + _sections(root, "", "")).rstrip("\n") + "\n"


def main(argv: list[str] | None = None, path: Path = DOC_PATH) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {path.name}")
    mode.add_argument("--check", action="store_true", help=f"exit 1 if {path.name} is stale")
    args = p.parse_args(argv)
    try:
        text = render()
    except ConfigDocError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.write:
        path.write_text(text)
    elif args.check:
        if not path.is_file() or path.read_text() != text:
            print(f"{path} is stale: regenerate it with `{COMMAND}`", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
