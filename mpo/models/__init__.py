"""Model building: megatron-core GPTModel with MoE layers, FP32 LM head, token log-probs."""
