"""Legacy ``colossalai.pipeline`` (PipelinableContext, pipeline stages) is not provided: colossal_lite has no
pipeline parallelism. Importing this module says what to do instead."""
raise ImportError("colossal_lite.pipeline (PipelinableContext, partitioning a model into pipeline stages) is not "
                  "supported by colossal_lite, which has no pipeline parallelism: build the whole model as a "
                  "torch.nn.Module and scale with data parallelism and zero = dict(stage=...) in config.py instead")
