"""The package SGLang's registry imports instead of its own models (:mod:`megarl.engine_process.model_registry`):
``served``, the served architecture's module alone."""
