"""The rehearsal of the GPU machine's install (prepare_wheels.sh --check), run by a Python 3.12 that has the
carried wheels on its path and no torch: every requirement of what was carried is met except torch, the carried
pydantic's compiled core loads and validates, and `import deepspeed` stops at torch and nowhere earlier.
Exit 0 when all of that holds; 1 with the reason otherwise."""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.requirements import Requirement

ON_THE_DEVICE_ONLY = {"torch"}  # the device image's own; no Python 3.12 build of it here


def unmet() -> list[str]:
    """Requirements (no extras) of the installed distributions that nothing installed satisfies."""
    have = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in metadata.distributions()}
    missing = []
    for dist in metadata.distributions():
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            name = req.name.lower().replace("_", "-")
            if name in ON_THE_DEVICE_ONLY:
                continue
            if name not in have or not req.specifier.contains(have[name], prereleases=True):
                missing.append(f"{dist.metadata['Name']} needs {text} (have {have.get(name, 'none')})")
    return missing


def main() -> int:
    print(f"python {sys.version.split()[0]}; deepspeed wheel {metadata.version('deepspeed')}")
    if missing := unmet():
        print("unmet requirements:\n  " + "\n  ".join(missing))
        return 1
    import hjson
    import pydantic
    import pydantic_core

    class Probe(pydantic.BaseModel):
        stage: int

    assert Probe(stage="2").stage == 2 and hjson.loads("{a: 1}") == {"a": 1}
    print(f"pydantic {pydantic.VERSION} (core {pydantic_core.__version__}) validates; hjson loads")
    try:
        import deepspeed  # noqa: F401
    except ModuleNotFoundError as err:
        if err.name != "torch":
            print(f"import deepspeed: missing {err.name}, which the wheels should have brought")
            return 1
        print("import deepspeed: stops at torch only (the device image has torch 2.11): ok")
        return 0
    print("import deepspeed: succeeded without torch?")
    return 1


if __name__ == "__main__":
    sys.exit(main())
