"""transformers (PyTorch CPU) as the reference implementation: used by tests and benchmarks."""
from __future__ import annotations

from pathlib import Path


def transformers_gguf_model(path):
    """transformers' own load of a GGUF checkpoint, in fp32 (its GGUF dequantisation and Q/K handling)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = Path(path)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    config.torch_dtype = torch.float32
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton,
                                   torch_dtype=torch.float32)["tensors"]
    model = AutoModelForCausalLM.from_config(config).float().eval()
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise RuntimeError(f"transformers GGUF load: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model
