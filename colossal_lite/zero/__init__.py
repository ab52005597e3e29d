"""Legacy ``colossalai.zero`` (ZeroInitContext, ShardedModelV2, ShardedOptimizerV2, shard strategies) is not
provided: ZeRO is a config key here. Importing this module says what to write instead."""
raise ImportError("colossal_lite.zero (ZeroInitContext, ShardedModelV2, ShardedOptimizerV2, shard strategies) is "
                  "not supported by colossal_lite: build the model and optimizer as usual, without "
                  "ZeroInitContext, and write zero = dict(stage=1|2|3) in config.py (torch's "
                  "ZeroRedundancyOptimizer / FSDP2; see docs/config.md)")
