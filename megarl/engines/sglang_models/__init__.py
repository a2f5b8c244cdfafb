"""The package SGLang's registry imports instead of its own models (:mod:`megarl.engines.model_registry`)."""
