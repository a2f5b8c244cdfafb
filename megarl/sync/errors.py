"""The error of a weight sync that failed or ran past its bound, raised by the driver's
:class:`megarl.sync.WeightSync` and by the trainer ranks' transports alike."""
from __future__ import annotations

TIMEOUT_KEY = "sync.timeout_s"  # the config key that bounds every group formation and collective


class WeightSyncError(RuntimeError):
    """A sync failed. ``version``: the version it was for (None on a trainer rank); ``failed``: URLs of
    engines that errored or could not be reached; ``held``: URLs of live engines that may hold part of
    the new weights and stay paused until :meth:`megarl.sync.WeightSync.recover`. Engines in neither
    kept their previous weights and resumed."""

    def __init__(self, message: str, version: int | None = None, failed: list[str] = (), held: list[str] = ()):
        super().__init__(message)
        self.version = version
        self.failed = list(failed)
        self.held = list(held)

    def __reduce__(self):  # Ray carries a rank's error to the driver by pickling it
        return type(self), (str(self), self.version, self.failed, self.held)


def past_bound(what: str, timeout_s: float) -> str:
    """The message of ``what`` not done within ``timeout_s`` seconds, naming the key that sets it."""
    return f"{what} did not finish within {TIMEOUT_KEY}={timeout_s:g} s"
