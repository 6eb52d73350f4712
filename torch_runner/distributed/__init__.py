"""Tensor parallel on torch.distributed: the process group, rank start-up, weight sharding and the
worker ranks' step loop. Imports the runner and models, never the engine or serve (rank 0's engine schedules)."""
