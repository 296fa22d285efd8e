"""The model's forward pass: paged attention, the lean Llama-family forward, GEMM forms."""
