"""The prefill's math in torch: the blocks (attention, MLP), RoPE, the linear-attention mixer
and its gated delta rule, a load's experts at once, MLX dequantization and K/V quantization."""
