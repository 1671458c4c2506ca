"""The config's error: one line naming the dotted key. Its own module so that the layer files, which declare
their config sections and rules, import it without loading the schema (which gathers those sections)."""


class ConfigError(ValueError):
    """A configuration problem; the message is one line naming the dotted key."""


def require(cond: bool, message: str) -> None:
    """A config rule: `message` (one line naming the key) as a ConfigError unless `cond` holds."""
    if not cond:
        raise ConfigError(message)
