"""Routing capture, replay (R2/R3), RSPO router inputs and consistency metrics for megatron-core MoE models."""
