"""An engine started without its tokenizer (``--skip-tokenizer-init``) ends responses where one with it does.

SGLang 0.5.23's scheduler ends a response at the EOS ids of ``config.json`` and ``generation_config.json``
(``ModelConfig.hf_eos_token_id``) and, only when it holds the tokenizer, also at the tokenizer's EOS id and
at SGLang's additional stop tokens (``Req._check_token_based_finish``). :func:`install` adds those two to
``hf_eos_token_id`` in a server started without the tokenizer, so skipping it changes no response.
"""
from __future__ import annotations

_original = None  # SGLang's ModelConfig._get_hf_eos_token_id, kept by install()


def tokenizer_stop_ids(tokenizer) -> set[int]:
    """The ids SGLang's scheduler stops at through ``tokenizer`` (one loaded by SGLang's ``get_tokenizer``):
    its EOS id and its ``additional_stop_token_ids``."""
    ids = set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def eos_ids_with_tokenizer_stops(model_config) -> set[int]:
    """SGLang's ``ModelConfig._get_hf_eos_token_id`` with the stop ids of the model's tokenizer added."""
    from sglang.srt.utils.hf_transformers import get_tokenizer

    ids = set(_original(model_config) or ())  # megarl serves the tokenizer of the model's directory
    return ids | tokenizer_stop_ids(get_tokenizer(model_config.model_path))


def install() -> None:
    """Route SGLang's EOS ids in this process through :func:`eos_ids_with_tokenizer_stops` (idempotent);
    for a server started with ``--skip-tokenizer-init`` only."""
    global _original
    from sglang.srt.configs.model_config import ModelConfig

    if ModelConfig._get_hf_eos_token_id is eos_ids_with_tokenizer_stops:
        return
    _original = ModelConfig._get_hf_eos_token_id
    ModelConfig._get_hf_eos_token_id = eos_ids_with_tokenizer_stops
