"""``torch.compile`` at a function's first call instead of where it is decorated.

``torch.compile`` imports TorchInductor as it decorates (CPU time and memory in every process), and
megatron and SGLang decorate dozens of kernels at import, most of which never run on their CPU paths.
:func:`compile_at_first_call` makes ``torch.compile(fn, **options)`` (and ``@torch.compile(**options)``)
return a wrapper that compiles ``fn`` with those options at its first call and calls the compiled
function from then on; modules and other callables are compiled at once, as ``torch.compile`` does.
Used by the CPU work-arounds of :mod:`megarl.platform.megatron_cpu` and :mod:`megarl.platform.sglang_cpu`.
"""
from __future__ import annotations

import functools
import inspect
import logging

import torch

log = logging.getLogger(__name__)


def compile_at_first_call() -> None:
    """Replace ``torch.compile`` (once per process) by its first-call form."""
    compile_now = torch.compile
    if getattr(compile_now, "compiles_at_first_call", False):
        return

    def compile_on_first_call(model=None, **options):
        if model is None:  # @torch.compile(option=...)
            return functools.partial(compile_on_first_call, **options)
        if not inspect.isfunction(model):
            return compile_now(model, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                log.info("torch.compile of %s.%s at its first call", model.__module__, model.__qualname__)
                compiled = compile_now(model, **options)
            return compiled(*args, **kwargs)

        return call

    compile_on_first_call.compiles_at_first_call = True
    torch.compile = compile_on_first_call
