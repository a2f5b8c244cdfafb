"""``EntryClass``: the model class(es) of the SGLang module named by ``MEGARL_SGLANG_MODEL_MODULE``."""
import importlib
import os

EntryClass = importlib.import_module(os.environ["MEGARL_SGLANG_MODEL_MODULE"]).EntryClass
