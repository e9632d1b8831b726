"""Model building: megatron-core GPTModel with MoE layers, FP32 LM head, token log-probs; the one HF <-> megatron
mapping (hf_mapping.py) and HF checkpoint reading (hf_source.py) that conversion, weight sync and the engine share."""
