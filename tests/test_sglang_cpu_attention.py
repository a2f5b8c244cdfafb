"""The batched torch-native attention (megarl/platform/sglang_cpu_attention.py) against SGLang's own
per-request loop on the same KV cache: requests of different lengths and cached prefixes, grouped-query
heads, batches split into chunks; and what it does not cover still reaches SGLang's loop."""
import pytest
import torch

from megarl.platform import sglang_cpu, sglang_cpu_attention

pytestmark = pytest.mark.unit

HEADS, KV_HEADS, DIM, SCALE = 4, 2, 16, 0.25


@pytest.fixture(scope="module")
def backend():
    """SGLang's TorchNativeAttnBackend class (the CPU work-arounds applied, the batched attention installed)."""
    sglang_cpu.apply()
    sglang_cpu_attention.install()
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return TorchNativeAttnBackend


def kv_pool(seq_lens: list[int], seed: int):
    """A shuffled KV cache of float32 slots, ``req_to_token`` rows holding each request's slots (the rest
    of each row stale slot ids, as in SGLang's pool) and the requests' pool indices (not in order)."""
    g = torch.Generator().manual_seed(seed)
    slots = sum(seq_lens) + 11
    k_cache, v_cache = torch.randn(slots, KV_HEADS, DIM, generator=g), torch.randn(slots, KV_HEADS, DIM, generator=g)
    order = torch.randperm(slots, generator=g).to(torch.int32)
    req_to_token = torch.randint(0, slots, (len(seq_lens) + 3, max(seq_lens) + 5), generator=g, dtype=torch.int32)
    pool_indices = torch.randperm(len(seq_lens) + 3, generator=g)[:len(seq_lens)]
    used = 0
    for b, n in enumerate(seq_lens):
        req_to_token[pool_indices[b], :n] = order[used:used + n]
        used += n
    return k_cache, v_cache, req_to_token, pool_indices, g


@pytest.mark.parametrize("max_gather", [sglang_cpu_attention.MAX_GATHER_ELEMENTS, 700])  # one chunk; several
def test_decode_equals_sglangs_loop(backend, monkeypatch, max_gather):
    monkeypatch.setattr(sglang_cpu_attention, "MAX_GATHER_ELEMENTS", max_gather)
    seq_lens = [5, 1, 9, 3, 9, 2, 7]
    k_cache, v_cache, req_to_token, pool_indices, g = kv_pool(seq_lens, seed=1)
    query = torch.randn(len(seq_lens), HEADS, DIM, generator=g)
    args = (k_cache, v_cache, req_to_token, pool_indices, torch.tensor(seq_lens))
    ours = backend._run_sdpa_forward_decode(None, query, torch.full_like(query, float("nan")), *args, None, SCALE,
                                            True)
    loop = backend._run_sdpa_forward_decode.loop(None, query, torch.empty_like(query), *args, None, SCALE, True)
    torch.testing.assert_close(ours, loop, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("max_gather", [sglang_cpu_attention.MAX_GATHER_ELEMENTS, 2000])
@pytest.mark.parametrize("causal", [True, False])
def test_extend_equals_sglangs_loop(backend, monkeypatch, max_gather, causal):
    monkeypatch.setattr(sglang_cpu_attention, "MAX_GATHER_ELEMENTS", max_gather)
    prefix, new = [0, 4, 2, 0, 6], [5, 1, 3, 8, 2]  # cached prefix tokens, tokens extended now
    seq_lens = [p + n for p, n in zip(prefix, new)]
    k_cache, v_cache, req_to_token, pool_indices, g = kv_pool(seq_lens, seed=2)
    query = torch.randn(sum(new), HEADS, DIM, generator=g)
    args = (k_cache, v_cache, req_to_token, pool_indices, torch.tensor(seq_lens), torch.tensor(prefix),
            torch.tensor(new), None, SCALE, True, causal)
    ours = backend._run_sdpa_forward_extend(None, query, torch.full_like(query, float("nan")), *args)
    loop = backend._run_sdpa_forward_extend.loop(None, query, torch.empty_like(query), *args)
    torch.testing.assert_close(ours, loop, rtol=1e-6, atol=1e-6)


def test_one_attention_call_per_layer_not_per_request(backend, monkeypatch):
    seq_lens = [4, 6, 3, 8, 5, 2]
    k_cache, v_cache, req_to_token, pool_indices, g = kv_pool(seq_lens, seed=3)
    query = torch.randn(len(seq_lens), HEADS, DIM, generator=g)
    calls = []
    sdpa = sglang_cpu_attention.scaled_dot_product_attention
    monkeypatch.setattr(sglang_cpu_attention, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or
                        sdpa(*a, **k))
    backend._run_sdpa_forward_decode(None, query, torch.empty_like(query), k_cache, v_cache, req_to_token,
                                     pool_indices, torch.tensor(seq_lens), None, SCALE, True)
    assert len(calls) == 1


def test_sliding_windows_stay_on_sglangs_loop(backend, monkeypatch):
    monkeypatch.setattr(sglang_cpu_attention, "decode", lambda *a, **k: pytest.fail("batched path taken"))
    seq_lens = [6, 9]
    k_cache, v_cache, req_to_token, pool_indices, g = kv_pool(seq_lens, seed=4)
    query = torch.randn(2, HEADS, DIM, generator=g)
    layer_backend = backend.__new__(backend)  # the loop's sliding-window mask is a method of the backend
    out = backend._run_sdpa_forward_decode(layer_backend, query, torch.empty_like(query), k_cache, v_cache,
                                           req_to_token, pool_indices, torch.tensor(seq_lens), None, SCALE, True,
                                           False, False, 3)
    assert torch.isfinite(out).all()
