"""ops.quant: compute from packed weights (MXFP4 experts, int8 / int4 linears) behind ops' signatures.

Imports torch (and triton, for CUDA kernels); never mlx, models, torch_runner, or the ops that call it.
"""
