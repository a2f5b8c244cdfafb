"""What megatron-core, megatron-bridge and SGLang need on a machine without a GPU (inactive on GPUs),
and, on every platform, how SGLang's processes pickle tensors beside megatron-core
(:mod:`megarl.platform.sglang_ipc`) and the routes an SGLang request keeps for its prefix and replays
when it computes it again (:mod:`megarl.platform.sglang_kept_routes`,
:mod:`megarl.platform.sglang_route_replay`)."""
