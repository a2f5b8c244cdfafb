"""Arithmetic of the parallelism and memory planner (``python -m megarl.plan``), one concept a module:
architecture resolution, parameter counts, trainer memory, engine memory, weight sync, the layout."""
