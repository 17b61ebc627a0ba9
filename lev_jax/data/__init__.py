"""lev-jax training data: source registry, splits, contamination guard, build and grain pipeline.

Names are imported lazily, so ``python -m data check`` and the split helpers never pay for grain.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BuildConfig": "build",
    "BuildResult": "build",
    "CoverageError": "build",
    "assemble": "build",
    "build": "build",
    "export_eval": "build",
    "read_split": "build",
    "write": "build",
    "ContaminationError": "guard",
    "Guard": "guard",
    "check_sources_file": "guard",
    "resolve_eval_subset": "guard",
    "default_eval_data_dir": "guard",
    "EVAL_DATA_ENV": "guard",
    "BatchPlan": "pipeline",
    "make_dataset": "pipeline",
    "make_iterator": "pipeline",
    "REGISTRY": "registry",
    "SourceSpec": "registry",
    "get_spec": "registry",
    "SpecError": "registry",
    "RecordError": "registry",
    "LabelError": "registry",
    "LocalSource": "sources",
    "SourceUnavailable": "sources",
    "SPLITS": "splits",
    "assign_split": "splits",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"lev_jax.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'lev_jax.data' has no attribute {name!r}")
