"""The placement rehearsal: a recipe's real start-up on fake GPU nodes, with stand-ins where the GPU work
would run, checked for what a GPU run depends on (docs/planner.md, "Placement rehearsal").

- :mod:`.fake_nodes`: nodes as Linux network namespaces on one bridge (also the multi-node tests');
- :mod:`.ray_nodes`: a Ray cluster over them, whose raylets declare GPUs;
- :mod:`.scale`: the rule that scales a recipe down to a few such nodes, keeping its shape;
- :mod:`.stand_ins`, :mod:`.stand_in_server`: the trainer ranks' and the engine servers' stand-ins;
- :mod:`.driver`: the real start-up per recipe, in node 0; :mod:`.checks`: what is checked;
- :mod:`.cluster`: the cluster brought up and the driver run (``python -m megarl.plan recipe=NAME --rehearse``).
"""
