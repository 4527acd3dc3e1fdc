"""The state layer: where an optimizer's numbers live. ``flat``: the flat buffer's layout
(parameters as views of one buffer, shard ranges); ``shards``: a rank's fp32 master and
moments for its shard; ``watch``: the witnesses of the user's writes to what we copy."""
