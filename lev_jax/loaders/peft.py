"""LoRA adapters in peft's on-disk format: `adapter_model.safetensors` + `adapter_config.json`.

A lev-jax adapter is `{"layers.3.self_attn.q_proj.kernel": {"a": [in, r], "b": [r, out]}}` over our
parameter paths (training.lora). peft stores the same low-rank pair per module under the transformers
model's names, `base_model.model.<module>.lora_A.weight` as [r, in] and `.lora_B.weight` as [out, r],
scaled by lora_alpha / r. Our parameter paths are transformers' module paths without the model's
prefix (`model.` for a causal LM, `model.language_model.` for a Qwen3.5 VL checkpoint), so the two
convert by renaming and transposing, both ways, losslessly.

A key without the `base_model.model.` prefix is a silent failure in peft (it loads lora_B as zeros:
the base model, unchanged), so `export` writes the full names and `read` requires them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from lev_jax.errors import CheckpointError

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
KERNEL = ".kernel"
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


def module_prefix(hf_config: dict) -> str:
    """The transformers model's prefix before our parameter paths (VL checkpoints nest the LM)."""
    return "model.language_model." if "text_config" in (hf_config or {}) else "model."


def hf_module(path: str, prefix: str) -> str:
    """`layers.3.self_attn.q_proj.kernel` -> `model.layers.3.self_attn.q_proj`; the head is `lm_head`."""
    if not path.endswith(KERNEL):
        raise ValueError(f"an adapter targets kernels, not {path!r}")
    module = path[: -len(KERNEL)]
    return module if module == "lm_head" else prefix + module


def is_peft_dir(path) -> bool:
    p = Path(path)
    return (p / ADAPTER_CONFIG).is_file() and (p / ADAPTER_WEIGHTS).is_file()


def export(out_dir, adapter: dict, *, rank: int, alpha: float, hf_config: dict, base_model: str) -> list[str]:
    """Write `adapter` (fp32) as a peft LoRA adapter directory; returns the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = module_prefix(hf_config)
    tensors, targets = {}, set()
    for path, ab in sorted(adapter.items()):
        module = hf_module(path, prefix)
        a, b = np.asarray(ab["a"], np.float32), np.asarray(ab["b"], np.float32)
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a.T)  # [r, in]
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b.T)  # [out, r]
        targets.add(module.rsplit(".", 1)[-1])
    save_file(tensors, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(rank),
        "lora_alpha": float(alpha),
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    return [ADAPTER_WEIGHTS, ADAPTER_CONFIG]


def read_config(adapter_dir) -> dict:
    p = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{p}: not a readable adapter config ({e})") from None


def read(adapter_dir, base_params: dict, hf_config: dict) -> tuple[dict, float]:
    """(adapter tree over our parameter paths, scale) of a peft LoRA directory for a base with
    `base_params`. Everything wrong (an unsupported setting, a key that is not a LoRA pair of a
    kernel of this base, a shape that does not fit) is collected into one CheckpointError."""
    from safetensors import safe_open

    from lev_jax.training import lora

    adapter_dir = Path(adapter_dir)
    cfg = read_config(adapter_dir)
    problems = []
    if cfg.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {cfg.get('peft_type')!r} (only LORA)")
    for key, ok, what in (
        ("use_dora", False, "DoRA"),
        ("bias", "none", "trained biases"),
        ("fan_in_fan_out", False, "fan_in_fan_out weights"),
    ):
        if cfg.get(key, ok) != ok:
            problems.append(f"{what} ({key}={cfg.get(key)!r})")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        problems.append("per-module rank_pattern / alpha_pattern")
    if cfg.get("modules_to_save"):
        problems.append(f"modules_to_save {cfg['modules_to_save']}")
    r, alpha = int(cfg.get("r", 0)), float(cfg.get("lora_alpha", 0))
    if r < 1:
        problems.append(f"r={r}")
    scale = alpha / (np.sqrt(r) if cfg.get("use_rslora") else r) if r > 0 else 0.0

    kernels = lora.shapes(base_params)
    prefix = module_prefix(hf_config)
    pairs: dict[str, dict] = {}
    try:
        handle = safe_open(str(adapter_dir / ADAPTER_WEIGHTS), framework="numpy")
    except Exception as e:  # noqa: BLE001 — any unreadable file is one clear error
        raise CheckpointError(f"{adapter_dir / ADAPTER_WEIGHTS}: not a readable safetensors file ({e})") from None
    with handle as f:
        for key in f.keys():
            m = _KEY.match(key)
            if not m:
                problems.append(f"unexpected tensor {key} (peft LoRA keys are {PEFT_PREFIX}<module>.lora_A/B.weight)")
                continue
            module = m["module"]
            if module != "lm_head" and not module.startswith(prefix):
                problems.append(f"{key}: module outside this base model ({prefix}...)")
                continue
            path = (module if module == "lm_head" else module[len(prefix) :]) + KERNEL
            if path not in kernels:
                problems.append(f"{key}: this base has no kernel {path}")
                continue
            arr = np.asarray(f.get_tensor(key), np.float32)
            pairs.setdefault(path, {})["a" if m["ab"] == "A" else "b"] = arr.T  # ours: a [in, r], b [r, out]
    adapter = {}
    for path, ab in sorted(pairs.items()):
        if set(ab) != {"a", "b"}:
            problems.append(f"{path}: lora_{'B' if 'a' in ab else 'A'} missing")
            continue
        w = kernels[path]
        want_a, want_b = (w.shape[0], r), (r, w.shape[1])
        if ab["a"].shape != want_a or ab["b"].shape != want_b:
            problems.append(
                f"{path}: A {ab['a'].T.shape} / B {ab['b'].T.shape}, expected {want_a[::-1]} / {want_b[::-1]}"
            )
            continue
        adapter[path] = ab
    if not adapter and not problems:
        problems.append("no LoRA tensors")
    if problems:
        raise CheckpointError(f"{adapter_dir} is not a LoRA adapter for this base: " + "; ".join(problems))
    return adapter, float(scale)
