"""The error types of configuration problems and the one-line form of their messages."""


class ConfigError(ValueError):
    """A recipe, override or input that cannot run; the message is one line naming the key."""


class PlacementError(ConfigError):
    """The layout cannot be placed on the cluster: more ranks than devices, or engine ranks that
    do not divide the model (``python -m megarl.plan`` exits 2 on it, as on a layout that does not
    fit in memory)."""


def one_line(text: str) -> str:
    """Messages of other libraries' errors may span lines; the CLI prints one."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def fail(key: str, why: str) -> None:
    """Raise :class:`ConfigError` ``"<key>: <why>"`` (``why`` on one line)."""
    raise ConfigError(f"{key}: {one_line(why)}")
