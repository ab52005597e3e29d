"""Legacy ``colossalai.global_variables`` (tensor_parallel_env, moe_env) is not provided: it held tensor-parallel
and MoE settings, features colossal_lite does not have. Importing this module says so."""
raise ImportError("colossal_lite.global_variables (tensor_parallel_env, moe_env) is not supported by colossal_lite: "
                  "it held tensor-parallel and MoE settings, and colossal_lite has neither; remove the import "
                  "(data parallelism needs no global settings; the parallel sizes are gpc.get_world_size(...))")
