"""transformers (PyTorch CPU) as the reference implementation, for parity tests and benchmarks.

torch and transformers are not core dependencies of lev-jax: they come with the test extra
(``pip install 'lev-jax[test]'``), and this module imports them only when called.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["transformers_gguf_model"]

_EXTRA_HINT = "pip install 'lev-jax[test]'"


def transformers_gguf_model(path):
    """transformers' own load of a GGUF checkpoint, in fp32 (its GGUF dequantisation and Q/K handling)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as e:
        raise ImportError(f"the PyTorch reference needs torch and transformers ({e}); {_EXTRA_HINT}") from e

    path = Path(path)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    config.torch_dtype = torch.float32
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32)[
        "tensors"
    ]
    model = AutoModelForCausalLM.from_config(config).float().eval()
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise RuntimeError(f"transformers GGUF load: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model
