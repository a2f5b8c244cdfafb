"""The SGLang engines, seen from the driver's side of their processes: the server process's launcher and
watch (``server``), how it is launched on a platform (``launch_plan``), colocated engines pinned beside
their trainer ranks (``pinning``), the HTTP client (``client``, with ``coalesce`` joining one event-loop
turn's calls), the types engines and their callers share (``types``), the Ray actor that supervises a
server (``actor``) and the start of a pool's actors (``supervisor``), the engine pool (``pool``) with its
members' states (``membership``) and prefix affinity (``affinity``), what rollout needs from engines
(``protocol``) and the ``/dev/shm`` clean-up (``shared_memory``). What runs inside SGLang's processes is
:mod:`megarl.engine_process`; what crosses between the two, :mod:`megarl.wire`. Nothing of rollout."""
