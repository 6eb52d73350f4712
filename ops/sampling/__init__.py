"""ops.sampling: the sampler (logits + per-row parameter tensors -> tokens, logprobs), its params and
seeded hash. Imports torch and ops' own helpers only: no models, no torch_runner, never mlx."""
