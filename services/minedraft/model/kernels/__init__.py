"""The model's kernels: the CPU ones in C, the GPU ones in Triton, each beside the Python that calls it.

- CPU, built on first use with the machine's C compiler (cpu_kernels.py) and called through ctypes:
  paged attention (cpu_attention.py, paged_attention.c), the layers' fused elementwise chains (cpu_fused.py,
  fused_layers.c) and a step's whole layer stack as one call (cpu_stack.py, decode_stack.c); the C sources
  share their vector types through vec.h.
- GPU (Triton): paged attention (triton_attention.py), the fused layer chains (triton_fused.py), batched LoRA
  (triton_lora.py), the quantized GEMMs (triton_quant.py) and the grouped MoE expert GEMMs (triton_moe.py).
  They import triton at module level: the model imports them only where they run.
"""
