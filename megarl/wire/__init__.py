"""What crosses between the driver side and the engines' SGLang processes, written and read on both
sides: the delta sync's encoding of a tensor's changed elements (``weight_delta``), the sharded sync's
slice entries and their assembly (``weight_shards``), a request's kept routes in its sampling
parameters (``routes``), a weight-update group's bound carried in its name (``group_timeout``) and what
a server process is started with beyond SGLang's arguments (``launch``), and an answer's per-token
metadata as binary arrays (``metadata``). Nothing of either side's code."""
