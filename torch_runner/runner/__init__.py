"""torch_runner.runner: device execution: the model runner, the CPU decode loop, CUDA graphs.
The only part that moves data to the device; imports kv and models, never the engine or serve."""
