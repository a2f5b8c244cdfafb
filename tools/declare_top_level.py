"""Write ``top_level.txt`` into every installed distribution that lacks one (run by tools/setup_venv.sh).

transformers calls ``importlib.metadata.packages_distributions()`` when it is imported, in every
process that imports it (the driver, each trainer rank, each engine, each tool). For a distribution
without ``top_level.txt`` (torch, numpy, scipy, pandas, openai, ... 68 of this lock's) Python infers
its top-level names from its ``RECORD``, checking that each listed file exists: ~31,000 ``stat`` calls,
0.6 s of every such import on this machine. Writing exactly the inferred names into the file
(Python's own ``_top_level_inferred``) leaves the mapping unchanged and makes the lookup a file read.
A distribution whose inferred list is empty is left as it is (an empty file would be read as absent).
Ray puts its vendored packages' directory (``ray/thirdparty_files``) on ``sys.path`` when it is
imported, so every Ray process's mapping sees those too: they are declared as well.

Usage: python tools/declare_top_level.py   (the running interpreter's site-packages)
"""
from __future__ import annotations

import importlib.metadata as metadata
import site
from collections.abc import Iterable
from pathlib import Path


def search_paths() -> list[str]:
    """The interpreter's site-packages and, as Ray adds it to ``sys.path`` on import, each one's
    ``ray/thirdparty_files``."""
    sites = site.getsitepackages()
    return [*sites, *(p for p in (str(Path(s) / "ray" / "thirdparty_files") for s in sites) if Path(p).is_dir())]


def declare_top_level(distributions: Iterable[metadata.Distribution]) -> list[str]:
    """Write the inferred top-level names of each distribution without ``top_level.txt``; return the
    names of the distributions written."""
    written = []
    for dist in distributions:
        if metadata._top_level_declared(dist):
            continue
        names = sorted(metadata._top_level_inferred(dist))
        path = getattr(dist, "_path", None)  # a PathDistribution's dist-info directory
        if not names or path is None:
            continue
        (Path(path) / "top_level.txt").write_text("".join(f"{name}\n" for name in names))
        written.append(dist.metadata["Name"])
    return written


if __name__ == "__main__":
    written = declare_top_level(metadata.distributions(path=search_paths()))
    print(f"declare_top_level: top_level.txt written for {len(written)} distributions")
