"""The releases of DeepSpeed and torch whose internals this package was checked against, and the refusal of the
corrections that are only right for that DeepSpeed release."""

CHECKED_AGAINST = {"deepspeed": "0.19.8", "torch": "2.13.0"}


def deepspeed_version_unchecked_for_overlap() -> str | None:
    """The installed DeepSpeed version when it is not the one `overlap_zero1_reduction` and
    `replace_zero_weight_gather` were checked against (and pyproject.toml pins), else None (read from the
    package's metadata: no `import deepspeed`, which probes the accelerator). Only an install that bypassed the
    pin (`--no-deps`, a machine's own DeepSpeed) gets another."""
    from importlib.metadata import version

    installed = version("deepspeed")
    return None if installed == CHECKED_AGAINST["deepspeed"] else installed


def require_checked_deepspeed(what: str) -> None:
    unchecked = deepspeed_version_unchecked_for_overlap()
    if unchecked is not None:
        raise RuntimeError(f"{what} is checked against deepspeed {CHECKED_AGAINST['deepspeed']}, not {unchecked}")
