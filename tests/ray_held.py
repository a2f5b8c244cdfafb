"""What runs left reserved on a Ray the test process keeps connected (tests/conftest.py, ``ray_local``)."""
import time


def held_resources(timeout_s: float = 30.0) -> dict[str, float]:
    """The resources (CPUs, placement-group bundles, ...) still reserved after waiting up to ``timeout_s``
    for them to come back ({} when none): an actor's come back a moment after it is killed."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        free = ray.available_resources()
        held = {k: v - free.get(k, 0) for k, v in ray.cluster_resources().items()
                if free.get(k, 0) != v and not k.startswith(("memory", "object_store"))}
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.2)
