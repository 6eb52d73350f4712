"""ops.cpu_native: AVX2 batch-1 linear kernels (fp32 / bf16 / int8 / int4 with q8 activations), C++ built on first use.

Imports torch and ops.quant; the kernels are torch custom ops (torch.ops.torch_runner_native) with fake impls.
"""
