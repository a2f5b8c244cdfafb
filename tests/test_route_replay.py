"""The engine replays the routes a prefix was computed with (megarl/engine_process/route_replay.py,
megarl/engine_process/kept_routes.py) and the client sends them (megarl/engines/client.py).

Unit: the gate weights of replayed ids against megatron-core's ``RouterReplay`` (the trainer's), a
batch's replayed rows, the top-k override and its refusal, the prefix cache's cut, the DP slot, the
routes' wire format and its refusals, the client's payload. On the shared CPU engine: a prefix
resubmitted with routes other than its cached ones is computed with them (its tokens then equal an HF
forward replaying them), and the KV computed with those routes stays out of the prefix cache (a plain
request of the same tokens after it reuses the router's own).
"""
from types import SimpleNamespace

import hf_oracle
import numpy as np
import pytest
import torch
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megarl.engine_process import route_replay
from megarl.engine_process.kept_routes import (
    KEPT_ROUTES,
    agreeing_rows,
    take_request_routes,
)
from megarl.engine_process.route_replay import (
    DpSlot,
    ForwardReplay,
    apply_replay,
    dp_slot_start,
    extend_replay,
    gathered_replay,
    replay_weights,
)
from megarl.engines.client import SGLangClient, generate_payload, shared_prompts
from megarl.engines.types import SamplingParams, ServedModel
from megarl.wire.routes import ROUTES_PARAM, decode_routes, encode_routes

unit = pytest.mark.unit


def megatron_replayed_probs(logits: torch.Tensor, ids: torch.Tensor, score: str, pre_softmax: bool) -> torch.Tensor:
    """The trainer's gate weights [n, k] at ``ids``: megatron-core's routing with a RouterReplay replaying them."""
    replay = RouterReplay()
    try:
        replay.set_target_indices(ids)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        probs, _ = topk_routing_with_score_function(logits, ids.shape[1], use_pre_softmax=pre_softmax,
                                                    score_function=score, router_replay=replay, dense_output=True)
    finally:
        RouterReplay.global_router_replay_instances.remove(replay)
    return probs


@unit
@pytest.mark.parametrize("score,renormalize", [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_replayed_gate_weights_are_megatron_replays(score, renormalize):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 8, generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(16)])
    # megatron's softmax without pre-softmax renormalises over the top-k (SGLang's renormalize=True)
    expected = megatron_replayed_probs(logits, ids, score, pre_softmax=not renormalize)
    torch.testing.assert_close(replay_weights(logits, ids, score, renormalize), expected, rtol=0, atol=1e-7)
    with pytest.raises(NotImplementedError, match="sqrtsoftplus"):
        replay_weights(logits, ids, "sqrtsoftplus", True)


def _req(kept=None):
    req = SimpleNamespace()
    if kept is not None:
        setattr(req, KEPT_ROUTES, torch.as_tensor(kept, dtype=torch.int32).view(-1, 1, 1))
    return req


@unit
def test_a_batch_replays_the_positions_its_requests_keep_routes_for():
    # request 0 keeps rows 0..4 and feeds 3..7; request 1 keeps none; request 2 keeps rows 0..1 and feeds 2..3
    reqs = [_req([10, 11, 12, 13, 14]), _req(), _req([20, 21])]
    ids, replayed, owner = extend_replay(reqs, [3, 0, 2], [5, 2, 2])
    assert replayed.tolist() == [True, True, False, False, False, False, False, False, False]
    assert ids[:2].flatten().tolist() == [13, 14] and owner.tolist() == [0] * 5 + [1] * 2 + [2] * 2
    assert extend_replay([_req(), _req([1, 2])], [0, 2], [3, 1]) is None  # nothing kept where the batch feeds


def _config(**overrides):
    config = dict(scoring_func="softmax", renormalize=True, apply_routed_scaling_factor_on_output=False,
                  routed_scaling_factor=None)
    return SimpleNamespace(**(config | overrides))


@unit
def test_replayed_rows_take_the_kept_experts_and_their_scores_and_are_marked_where_the_router_differs():
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    chosen = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    kept = torch.tensor([[[1, 0]], [[5, 4]], [[0, 0]]], dtype=torch.int32)  # row 0 the same set, row 1 others
    replay = ForwardReplay(ids=kept, replayed=torch.tensor([True, True, False]), rerouted=torch.zeros(3, dtype=bool))
    ids, weights = chosen.clone(), torch.full((3, 2), 0.5)
    apply_replay(replay, 0, ids, weights, logits, _config(apply_routed_scaling_factor_on_output=True,
                                                         routed_scaling_factor=2.0))
    assert ids.tolist() == [[1, 0], [5, 4], [4, 5]] and weights[2].tolist() == [0.5, 0.5]
    torch.testing.assert_close(weights[:2], 2 * torch.softmax(logits[:2].gather(1, ids[:2].long()), -1))
    assert replay.rerouted.tolist() == [False, True, False]
    with pytest.raises(RuntimeError, match="top-k ids where the batch replays"):  # a fused shared expert's column
        apply_replay(replay, 0, torch.zeros(3, 3, dtype=torch.int32), torch.zeros(3, 3), logits, _config())
    with pytest.raises(RuntimeError, match="packs its top-k ids"):  # ids the experts read before the override
        apply_replay(replay, 0, chosen.clone(), weights, logits, _config(fused_gate_packed_ids=True))


@unit
def test_a_cached_prefix_is_reused_up_to_its_first_row_routed_otherwise():
    kept = torch.arange(12).view(4, 3, 1)
    cached = torch.cat([kept, torch.zeros(2, 3, 1, dtype=kept.dtype)])  # 6 cached rows, the last 2 past the kept
    assert agreeing_rows(cached, kept) == 6
    cached[2, 1, 0] = 99
    assert agreeing_rows(cached, kept) == 2
    assert agreeing_rows(cached[:2], kept) == 2


@unit
def test_a_dp_rank_s_rows_start_after_the_ranks_before_it_or_at_its_equal_slot():
    assert dp_slot_start([3, 5, 2], 2, 10, max_padding=False) == 8
    assert dp_slot_start([3, 5, 2], 2, 15, max_padding=True) == 10
    assert dp_slot_start([3, 5, 2], 0, 15, max_padding=True) == 0


@unit
def test_dp_ranks_gather_each_other_s_replayed_rows_into_their_slots(monkeypatch):
    """Two DP ranks (3 and 2 tokens, gathered end to end into 5 rows): the sum of what each puts in its slot
    (the all-reduce, stood in for) holds every rank's replayed rows, and nothing where none is replayed."""
    sent = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda codes, group: sent.append(codes))
    ids = torch.arange(12, dtype=torch.int32).view(3, 2, 2)
    rank0 = ForwardReplay(ids=ids, replayed=torch.tensor([True, False, True]), rerouted=torch.zeros(3, dtype=bool))
    rank1 = ForwardReplay(ids=ids[:2] + 100, replayed=torch.tensor([False, True]), rerouted=torch.zeros(2, dtype=bool))
    gathered_replay(rank0, 5, DpSlot(start=0, writes=True, shape=(2, 2), group=None))
    gathered_replay(rank1, 5, DpSlot(start=3, writes=True, shape=(2, 2), group=None))
    gathered_replay(rank1, 5, DpSlot(start=3, writes=False, shape=(2, 2), group=None))  # its attention-TP peer
    total = sum(sent)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda codes, group: codes.copy_(total))
    both = gathered_replay(rank1, 5, DpSlot(start=3, writes=True, shape=(2, 2), group=None))
    assert both.replayed.tolist() == [True, False, True, False, True] and both.start == 3
    assert both.ids[[0, 2, 4]].tolist() == [ids[0].tolist(), ids[2].tolist(), (ids[1] + 100).tolist()]


class _Mode:
    def __init__(self, extend: bool):
        self.extend = extend

    def is_extend(self) -> bool:
        return self.extend


def _batch(kept_rows: list | None, extend=True, prefix=0, length=2):
    """A one-request batch feeding ``length`` positions from ``prefix``; its request keeps ``kept_rows``."""
    req = _req(kept_rows)
    req.skip_radix_cache_insert = False
    return SimpleNamespace(reqs=[req], prefix_lens=[prefix], extend_lens=[length], forward_mode=_Mode(extend))


@unit
def test_a_replayed_forward_runs_off_the_prefill_graph_and_keeps_rerouted_kv_out_of_the_cache(monkeypatch):
    monkeypatch.setattr(route_replay, "_dp_attention", lambda: (False, False))
    graphs = object()
    worker = SimpleNamespace(model_runner=SimpleNamespace(device="cpu", prefill_cuda_graph_runner=graphs))
    batch = _batch([5, 6])
    with route_replay.replaying(worker, batch):
        active = route_replay._active
        assert worker.model_runner.prefill_cuda_graph_runner is None and active.replayed.tolist() == [True, True]
        active.layers, active.rerouted[1] = 1, True  # a layer replayed, the router would have chosen otherwise
    assert worker.model_runner.prefill_cuda_graph_runner is graphs and route_replay._active is None
    assert batch.reqs[0].skip_radix_cache_insert
    agreeing = _batch([5, 6])
    with route_replay.replaying(worker, agreeing):
        route_replay._active.layers = 1
    assert not agreeing.reqs[0].skip_radix_cache_insert  # the router's own routes: ordinary KV, shared
    with route_replay.replaying(worker, _batch([5, 6], prefix=2)):  # nothing kept where it feeds
        assert route_replay._active is None and worker.model_runner.prefill_cuda_graph_runner is graphs
    with pytest.raises(RuntimeError, match="routed no MoE layer"):  # a top-k format that skips select_experts
        with route_replay.replaying(worker, _batch([5, 6])):
            pass
    assert worker.model_runner.prefill_cuda_graph_runner is graphs


@unit
def test_a_dp_rank_votes_against_the_prefill_graph_for_a_batch_it_replays(monkeypatch):
    asked = []
    monkeypatch.setattr(route_replay, "_original_vote", lambda **kwargs: asked.append(kwargs) or True)
    assert route_replay.prefill_graph_vote(local_batch=_batch([5, 6]), num_tokens=2) is False
    assert route_replay.prefill_graph_vote(local_batch=_batch(None), num_tokens=2) is True
    assert route_replay.prefill_graph_vote(local_batch=None, num_tokens=0) is True and len(asked) == 2


@unit
def test_routes_travel_as_json_scalars_and_come_back_equal_or_are_refused():
    routes = np.random.default_rng(0).integers(0, 8, (5, 2, 2)).astype(np.int16)
    entry = encode_routes(routes)
    assert all(isinstance(v, (int, str)) for v in entry.values())
    assert decode_routes(entry, (2, 2), 8, 5).numpy().tolist() == routes.tolist()
    for bad, why in [(entry, "at most 4 rows"), ({**entry, "layers": 3}, "routes 2 x 2"),
                     ({**entry, "ids": entry["ids"][:8]}, "experts in"), ({"rows": 5}, "must hold")]:
        with pytest.raises(ValueError, match=ROUTES_PARAM):
            decode_routes(bad, (2, 2), 8, 4 if why == "at most 4 rows" else 5)
    with pytest.raises(ValueError, match="experts in"):
        decode_routes(encode_routes(routes + 8), (2, 2), 8, 5)


@unit
def test_a_request_s_routes_move_off_its_parameters_and_a_bad_entry_aborts_it():
    routes = np.ones((3, 2, 2), np.int32)
    aborted = []
    req = SimpleNamespace(origin_input_ids=[1, 2, 3, 4], set_finish_with_abort=aborted.append,
                          sampling_params=SimpleNamespace(custom_params={ROUTES_PARAM: encode_routes(routes), "x": 1}))
    take_request_routes(req, (2, 2), 8)
    assert getattr(req, KEPT_ROUTES).tolist() == routes.tolist() and req.sampling_params.custom_params == {"x": 1}
    req.sampling_params.custom_params = {ROUTES_PARAM: encode_routes(np.ones((4, 2, 2), np.int32))}
    take_request_routes(req, (2, 2), 8)  # 4 rows for a 4-token prompt: its last token has none
    assert len(aborted) == 1 and ROUTES_PARAM in aborted[0] and req.sampling_params.custom_params is None
    req.sampling_params.custom_params = {ROUTES_PARAM: encode_routes(routes)}
    take_request_routes(req, None, 8)  # an engine that captures no routes cannot replay them: refused, not ignored
    assert len(aborted) == 2 and "--enable-return-routed-experts" in aborted[1]


@unit
def test_the_client_sends_a_prompt_s_routes_in_its_own_parameters_and_leaves_it_out_of_the_shared_prefill():
    params = SamplingParams(max_new_tokens=4, top_k=5)
    routes = np.zeros((3, 2, 2), np.int16)
    payload = generate_payload([[1, 2, 3, 4], [1, 2, 3, 4]], params, True, True, prefix_routes=[routes, None])
    first, second = payload["sampling_params"]
    assert first["custom_params"][ROUTES_PARAM] == encode_routes(routes) and "custom_params" not in second
    assert generate_payload([[1, 2]], params, True, True, prefix_routes=[None])["sampling_params"] == params.to_json()
    assert shared_prompts([[1, 2, 3, 4]] * 3, 1) == [0]
    assert shared_prompts([[1, 2, 3, 4]] * 3, 1, [routes, None, None]) == [1]
    client = SGLangClient("http://unused", ServedModel(vocab_size=16, num_layers=2, topk=2, num_experts=4,
                                                       context_length=64))
    for bad in (np.zeros((4, 2, 2), np.int16), np.zeros((3, 3, 2), np.int16), np.full((3, 2, 2), 4, np.int16)):
        with pytest.raises(ValueError, match="prefix routes"):
            client._validate_routes([1, 2, 3, 4], bad)


def test_a_prefix_cached_with_other_routes_is_computed_with_its_own_and_kept_out_of_the_cache(client, tiny_checkpoint,
                                                                                            loop):
    hf = hf_oracle.load_hf(tiny_checkpoint)
    params = SamplingParams(max_new_tokens=12, top_k=10, ignore_eos=True)

    async def body():
        [first] = await client.generate_batch([list(range(5, 15))], params, group_ids=["g"])
        prefix = first.prompt_ids + first.response_ids[:6]  # cached by the first request, with its own routes
        rotated = (first.routed_experts[:len(prefix) - 1].astype(np.int64) + 3) % hf.config.num_experts
        [replayed] = await client.generate_batch([prefix], params, group_ids=["g"], prefix_routes=[rotated])
        [plain] = await client.generate_batch([prefix], params, group_ids=["g"])
        return first, prefix, rotated, replayed, plain

    first, prefix, rotated, replayed, plain = loop.run_until_complete(body())
    np.testing.assert_array_equal(replayed.routed_experts[:len(prefix) - 1], rotated)
    worst = hf_oracle.assert_sample_matches_replayed_hf(replayed, hf, 1e-5, first_routed=len(prefix) - 1)
    # the rotated KV never entered the cache: the plain request reuses the first one's, with its routes
    assert plain.cached_tokens == len(prefix) - 1
    np.testing.assert_array_equal(plain.routed_experts[:len(prefix) - 1], first.routed_experts[:len(prefix) - 1])
    print(f"\n[measured] a prefix replayed over other cached routes: max |log-prob - HF replayed| {worst:.1e}")
