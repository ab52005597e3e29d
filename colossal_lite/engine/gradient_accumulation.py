"""Legacy ``colossalai.engine.gradient_accumulation`` (accumulate_gradient and the GradAccum* wrappers) is not
provided: accumulation is part of the engine, chosen by the config. Importing this module says how to ask for it."""
raise ImportError("colossal_lite.engine.gradient_accumulation (accumulate_gradient, GradAccumOptimizer, "
                  "GradAccumDataloader, GradAccumLrSchedulerByStep, GradAccumGradientHandler) is not provided: "
                  "write gradient_accumulation = N in config.py and colossal_lite.initialize returns the engine, "
                  "loader and scheduler that accumulate N micro-batches per optimizer step (docs/config.md)")
