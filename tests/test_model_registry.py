"""megarl/engine_process/model_registry.py: SGLang's registry imports the served architecture's module alone and
resolves every architecture to the class SGLang's own full registry gives."""
import json
import os
import sys

import fresh_python
import pytest

from megarl.engine_process.model_registry import MODULE_VARIABLE, install, served_architectures

# A fresh process: install() for a server of the given checkpoint, then SGLang's registry as its model
# loader uses it: the served architecture, then another one (e.g. a draft model's), then SGLang's full
# registry against defining_module() for every architecture in it.
SERVER = """
import json, sys
from megarl.engine_process import model_registry
from megarl.platform import sglang_cpu
installed = model_registry.install(["--model-path", sys.argv[1]])
sglang_cpu.apply()
from sglang.srt.models.registry import ModelRegistry, import_model_classes
imported = sorted(m for m in sys.modules if m.startswith("sglang.srt.models.") and m != "sglang.srt.models.registry")
resolved = {}
for arch in ("Qwen3MoeForCausalLM", "Dots3NoteForCausalLM"):
    cls, name = ModelRegistry.resolve_model_cls([arch])
    resolved[arch] = [f"{cls.__module__}.{cls.__qualname__}", name, len(ModelRegistry.models)]
registered = import_model_classes("sglang.srt.models")  # SGLang's full registry: architecture -> class
agreement = {arch: [cls.__module__, model_registry.defining_module(arch)] for arch, cls in registered.items()}
print(json.dumps({"installed": installed, "imported": imported, "resolved": resolved, "agreement": agreement}))
"""


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_EXTERNAL_MODEL_PACKAGE", MODULE_VARIABLE)}
    done = fresh_python.run([sys.executable, "-c", SERVER, tiny_checkpoint], env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.processes
def test_the_served_architecture_comes_from_its_module_alone(server):
    assert server["installed"] == "sglang.srt.models.qwen3_moe"
    # qwen3_moe and what it imports (SGLang's own registry imports all ~260 modules)
    assert "sglang.srt.models.qwen3_moe" in server["imported"] and len(server["imported"]) < 10
    cls, arch, registered = server["resolved"]["Qwen3MoeForCausalLM"]
    assert (cls, arch, registered) == ("sglang.srt.models.qwen3_moe.Qwen3MoeForCausalLM", "Qwen3MoeForCausalLM", 1)


@pytest.mark.processes
def test_another_architecture_resolves_through_sglangs_full_registry(server):
    # Dots3's model lives in a subpackage, which the source scan does not read: SGLang imports every model
    cls, arch, registered = server["resolved"]["Dots3NoteForCausalLM"]
    assert cls == "sglang.srt.models.dots3_common.modeling.Dots3NoteForCausalLM" and registered > 200


@pytest.mark.processes
def test_defining_module_is_the_module_sglangs_registry_takes_each_architecture_from(server):
    found = server["agreement"]
    assert len(found) > 200 and found["DeepseekV3ForCausalLM"] == ["sglang.srt.models.deepseek_v2"] * 2
    assert found["Glm4MoeForCausalLM"] == ["sglang.srt.models.glm4_moe"] * 2
    # qwen3.py defines a Qwen3Model too (the backbone), but SGLang registers qwen3_embedding's
    assert found["Qwen3Model"] == ["sglang.srt.models.qwen3_embedding"] * 2
    # a module found is always the registry's; None only for classes registered from subpackages
    assert all(ours in (theirs, None) for theirs, ours in found.values()), found
    assert all(theirs.count(".") > 3 for theirs, ours in found.values() if ours is None)


@pytest.mark.unit
def test_served_architectures_reads_the_override_then_the_checkpoint(tiny_checkpoint):
    assert served_architectures(["--model-path", tiny_checkpoint]) == ["Qwen3MoeForCausalLM"]
    assert served_architectures([f"--model-path={tiny_checkpoint}", "--json-model-override-args",
                                 '{"architectures": ["DeepseekV3ForCausalLM"]}']) == ["DeepseekV3ForCausalLM"]
    assert served_architectures(["--model-path", "Qwen/Qwen3-30B-A3B"]) == []
    for bad in ("{not json", "[1, 2]"):
        with pytest.raises(ValueError, match="--json-model-override-args is not a JSON object"):
            served_architectures(["--model-path", tiny_checkpoint, "--json-model-override-args", bad])


@pytest.mark.unit
def test_a_hub_id_or_a_users_own_model_package_leaves_sglang_as_it_is(tiny_checkpoint, monkeypatch):
    monkeypatch.delenv("SGLANG_EXTERNAL_MODEL_PACKAGE", raising=False)
    monkeypatch.delenv(MODULE_VARIABLE, raising=False)
    assert install(["--model-path", "Qwen/Qwen3-30B-A3B"]) is None
    assert "SGLANG_EXTERNAL_MODEL_PACKAGE" not in os.environ and MODULE_VARIABLE not in os.environ
    monkeypatch.setenv("SGLANG_EXTERNAL_MODEL_PACKAGE", "my_models")
    assert install(["--model-path", tiny_checkpoint]) is None
    assert os.environ["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "my_models" and MODULE_VARIABLE not in os.environ
