"""The one error type of configuration problems."""


class ConfigError(ValueError):
    """A recipe, override or input that cannot run; the message is one line naming the key."""
