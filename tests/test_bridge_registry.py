"""megarl/models/bridge_registry.py: a trainer rank imports the checkpoint's bridge alone, converts with it,
and megatron-bridge's full registry comes back whole whenever it is asked for."""
import json
import sys

import fresh_python
import pytest

# A fresh process, as a trainer rank: load_bridge() on the tiny checkpoint and its Megatron provider; what
# `from megatron.bridge import AutoBridge` then gives; then the full registry, against registering_module().
RANK = """
import json, sys
from megarl.models.bridge import load_bridge
bridge = load_bridge(sys.argv[1])
provider = bridge.to_megatron_provider(load_weights=False)
families = sorted({m.split(".")[3] for m in sys.modules
                   if m.count(".") > 3 and m.startswith("megatron.bridge.models.")})
from megatron.bridge import AutoBridge
lean = [AutoBridge is type(bridge), len(AutoBridge.list_supported_models())]
from megarl.models.bridge_registry import full_auto_bridge, registering_module
from megatron.bridge.models.conversion import model_bridge
full = full_auto_bridge()
agreement = {}
for key, impl in model_bridge.get_model_bridge._exact_types.items():
    name = key if isinstance(key, str) else key.__name__
    bridge_class = next(c.cell_contents for c in impl.__closure__ if isinstance(c.cell_contents, type))
    agreement[name] = [bridge_class.__module__, registering_module(name)]
print(json.dumps({"provider": type(provider).__name__, "layers": provider.num_layers, "families": families,
                  "lean": lean, "full": [full is AutoBridge, len(full.list_supported_models())],
                  "agreement": agreement}))
"""


@pytest.fixture(scope="module")
def rank(tiny_checkpoint):
    done = fresh_python.run([sys.executable, "-c", RANK, tiny_checkpoint], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.processes
def test_a_rank_imports_the_checkpoints_family_alone_and_builds_with_it(rank, tiny_checkpoint):
    config = json.loads(open(f"{tiny_checkpoint}/config.json").read())
    assert rank["provider"] == "GPTModelProvider" and rank["layers"] == config["num_hidden_layers"]
    families = set(rank["families"]) - {"common", "conversion", "decorators", "hf_pretrained", "_deprecation",
                                        "config", "gpt_provider", "model_provider", "transformer_config"}
    assert families == {"qwen"}, rank["families"]  # megatron-bridge's own __init__ imports ~60
    is_auto_bridge, registered = rank["lean"]
    assert is_auto_bridge and 1 <= registered < 10  # qwen's bridges only


@pytest.mark.processes
def test_the_full_registry_comes_back_when_asked_for(rank):
    is_auto_bridge, registered = rank["full"]
    assert is_auto_bridge and registered > 50 and registered == len(rank["agreement"])


@pytest.mark.processes
def test_registering_module_is_the_module_each_bridge_is_registered_from(rank):
    found = rank["agreement"]
    assert found["Qwen3MoeForCausalLM"] == ["megatron.bridge.models.qwen.qwen3_moe_bridge"] * 2
    assert found["DeepseekV3ForCausalLM"][0] == found["DeepseekV3ForCausalLM"][1]
    # a name given through a constant (source=_ERNIE45_MOE_HF_CLASS_NAME) is read through it
    assert found["Ernie4_5_MoeForCausalLM"] == ["megatron.bridge.models.ernie.ernie_45_bridge"] * 2
    # a module found is always the registry's; None only for bridges registered by a call, not the decorator
    assert all(ours in (theirs, None) for theirs, ours in found.values()), found
    assert sum(ours is None for _, ours in found.values()) <= 5


@pytest.mark.unit
def test_an_unknown_or_unregistered_architecture_takes_the_full_registry():
    from megarl.models.bridge_registry import registering_module

    assert registering_module("NoSuchForCausalLM") is None
    assert registering_module("ExaoneMoEForCausalLM") is None  # registered by register_bridge_implementation()
    # the docstring example in model_bridge.py (`register_bridge(source=LlamaForCausalLM`) is not a registration
    assert registering_module("LlamaForCausalLM") == "megatron.bridge.models.llama.llama_bridge"
