"""torch_runner package."""
