"""A training step's routing choice (megarl.trainer.routing_replay.StepRouting): replay, record or neither.

The numbers under replay and record (agreement, log-probs equal to the engine's) are checked on real
models in tests/test_layouts.py; here, which one a step takes and the refusals, with stand-in routers.
"""
import pytest
from megatron.core.transformer.moe.router_replay import RouterReplay

from megarl.trainer.routing_replay import StepRouting

pytestmark = pytest.mark.unit


@pytest.fixture
def routers(monkeypatch):
    """Sets the model's replay routers to the list the test passes."""
    def put(instances: list) -> None:
        monkeypatch.setattr(RouterReplay, "global_router_replay_instances", instances)
    return put


def test_keep_routing_without_routes_or_replay_routers_is_refused(routers):
    routers([object()])
    with pytest.raises(ValueError, match="keep_routing needs routed_experts"):
        StepRouting(keep_routing=True, routed=False, sequence_parallel=False)
    routers([])  # a model built without routing replay
    with pytest.raises(ValueError, match="a model built with routing replay"):
        StepRouting(keep_routing=True, routed=True, sequence_parallel=False)


@pytest.mark.parametrize("keep_routing,routed,has_routers,record,measured", [
    (True, True, True, False, True),  # replay, agreement counted beside it
    (False, True, True, True, True),  # the trainer's own choice recorded and compared
    (False, False, True, False, False),  # no engine routes to compare with
    (False, True, False, False, False),  # no replay routers: the routers just choose
])
def test_a_step_replays_records_or_leaves_the_routers_alone(routers, keep_routing, routed, has_routers, record,
                                                            measured):
    routers([object()] if has_routers else [])
    routing = StepRouting(keep_routing=keep_routing, routed=routed, sequence_parallel=False)
    assert (routing.record, routing.measured) == (record, measured)
    assert routing.counts == [0.0, 0.0]
