"""Models: loading, the stock forward with the engine attention, the fused forwards, quantization."""
