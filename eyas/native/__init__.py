"""Native CPU weights: the GGUF reader (gguf_file), the GGUF's quantized matrices as linear layers (quant), and
the C kernels (*.c, kernels.h) with their ctypes binding (kernels). Each module has its own error type."""
