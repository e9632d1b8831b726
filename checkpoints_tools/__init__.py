"""Hugging Face <-> megatron-core (torch_dist) checkpoint conversion for mpo's MoE models.

API:
    hf_to_mcore(hf_dir, out_dir, spec="both")   -> ConversionReport
    mcore_to_hf(mcore_dir, out_dir)             -> ConversionReport
    verify(hf_dir, mcore_dir, tp=1, ep=1, pp=1) -> VerifyReport        (checkpoints_tools.verify)
    mapping_for(model_config) -> ModelMapping   (the one name/layout mapping, mpo.models.hf_mapping; weight sync and
                                                 mpo's engine use it too)
CLI: python -m checkpoints_tools {hf-to-mcore, mcore-to-hf, verify} ...
"""

from checkpoints_tools.convert import ConversionReport, hf_to_mcore, mcore_to_hf
from mpo.models.hf_mapping import ModelMapping, mapping_for, model_config_from_hf
from mpo.models.hf_source import ConversionError

__all__ = ["ConversionError", "ConversionReport", "ModelMapping", "hf_to_mcore", "mapping_for", "mcore_to_hf",
           "model_config_from_hf"]
