"""Questions in the Jev shape, per split.

* test: the source's canonical question (canonical wording, full option set in canonical order,
  descriptions kept, never negated);
* calibration: canonical wording, but the option set varies across the option-count bands the
  source can reach (small <= 8, mid 9-26, large > 26) so every band gets rows;
* train: paraphrased wording; choice option sets subsampled (gold kept), shuffled and sometimes
  stripped of descriptions; large taxonomies (> 26 options) keep the full set in canonical order
  half the time ("Mode B" data) and are otherwise cut to >= 15 options (and <= max_subset_options);
  Noul questions are negated (target flipped) at the source's negation fraction and sometimes lose
  their yes/no criteria.

Targets: choice -> option key, score -> level index, Noul -> rating 8 (yes) or 0 (no).
``target_dist`` is the matching one-hot (uniform for abstain rows) over the criteria order, the
levels, or the nine Noul ratings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lev_jax.data.registry import LETTERS, SourceSpec
from lev_jax.data.splits import HashRng, reachable_bands
from lev_jax.domain import BAND_RANGES, CHOICE, NOUL, RATING_LEVELS, RATING_NO, RATING_YES, SCORE, band_of

LARGE_TAXONOMY = BAND_RANGES["mid"][1]  # more options than the mid band holds is a large taxonomy


@dataclass(frozen=True)
class QuestionConfig:
    strip_fraction: float = 0.3  # train: choice descriptions dropped
    full_set_fraction: float = 0.5  # train: large taxonomies keep the full canonical set (Mode B)
    min_large_options: int = 15  # train: large taxonomies are otherwise cut to at least this many
    # train: > 0, a large taxonomy's subsets list at most this many options (0: up to all but one).
    # At most LARGE_TAXONOMY, every large-band train question is then the full set in canonical order
    # (a few distinct questions, many records each), the subsets small / mid choices
    max_subset_options: int = 0
    noul_null_criteria_fraction: float = 0.3  # train: Noul criteria set to null


def _choice_options(spec: SourceSpec, ex: dict[str, Any]) -> tuple[list[tuple[str, str | None]], str, bool]:
    if spec.kind == "mcq":
        return [(LETTERS[i], t) for i, t in enumerate(ex["options"])], ex["label"], True
    return [(o.key, o.description) for o in spec.options], ex["label"], False


def _subset(opts: list[tuple[str, str | None]], gold: str, k: int, rng: HashRng) -> list[tuple[str, str | None]]:
    others = [o for o in opts if o[0] != gold]
    keep = rng.sample(others, k - 1) + [next(o for o in opts if o[0] == gold)]
    rng.shuffle(keep)
    return keep


def make_question(
    spec: SourceSpec,
    ex: dict[str, Any],
    split: str,
    rng: HashRng,
    cfg: QuestionConfig = QuestionConfig(),
    negate: bool | None = None,
) -> dict[str, Any]:
    """{question, target, target_dist, n_options, band, negated, full_options, canonical}."""
    canonical = split == "test"
    if spec.primitive == CHOICE:
        opts, gold, relabel = _choice_options(spec, ex)
        n = len(opts)
        full = True
        if split == "test":
            chosen = list(opts)
        elif split == "calibration":
            band = rng.choice(reachable_bands(n))
            lo, hi = BAND_RANGES[band]
            k = rng.randint(lo, n if hi is None else min(hi, n))
            chosen = _subset(opts, gold, k, rng)
            full = k == n
        else:
            if n > LARGE_TAXONOMY and rng.random() < cfg.full_set_fraction:
                chosen = list(opts)  # Mode B: the whole taxonomy, canonical order
            else:
                lo = min(cfg.min_large_options, n) if n > LARGE_TAXONOMY else min(2, n)
                hi = n - 1 if n > LARGE_TAXONOMY else n
                if n > LARGE_TAXONOMY and cfg.max_subset_options > 0:
                    hi = min(hi, cfg.max_subset_options)
                    lo = min(lo, hi)
                k = rng.randint(lo, hi)
                chosen = _subset(opts, gold, k, rng)
                full = k == n
            if spec.strip_descriptions and rng.random() < cfg.strip_fraction:
                chosen = [(key, None) for key, _ in chosen]
        if relabel:  # MCQ: letters follow the presented order
            target = LETTERS[[key for key, _ in chosen].index(gold)]
            chosen = [(LETTERS[i], d) for i, (_, d) in enumerate(chosen)]
        else:
            target = gold
        instructions = spec.instructions[0] if split != "train" else rng.choice(spec.instructions)
        criteria = {key: desc for key, desc in chosen}
        dist = [1.0 if key == target else 0.0 for key in criteria]
        return dict(
            question={"type": CHOICE, "instructions": instructions, "criteria": criteria},
            target=target,
            target_dist=dist,
            n_options=len(criteria),
            band=band_of(len(criteria)),
            negated=False,
            full_options=full,
            canonical=canonical,
        )
    if spec.primitive == SCORE:
        paraphrases = spec.aspect_instructions[ex["aspect"]] if spec.aspect_instructions else spec.instructions
        instructions = paraphrases[0] if split != "train" else rng.choice(paraphrases)
        levels = list(spec.levels)
        dist = [1.0 if i == ex["label"] else 0.0 for i in range(len(levels))]
        q = {"type": SCORE, "instructions": instructions, "criteria": levels}
        return dict(
            question=q,
            target=ex["label"],
            target_dist=dist,
            n_options=len(levels),
            band=band_of(len(levels)),
            negated=False,
            full_options=True,
            canonical=canonical,
        )
    # Noul
    assert spec.yes_no is not None
    if negate is None:
        negate = split == "train" and rng.random() < spec.negation_fraction
    if split == "train":
        instructions = rng.choice(spec.negations if negate else spec.instructions)
    else:
        instructions = spec.negations[0] if negate else spec.instructions[0]
    yes, no = spec.yes_no
    criteria: dict[str, str] | None = {"true": no, "false": yes} if negate else {"true": yes, "false": no}
    if split == "train" and rng.random() < cfg.noul_null_criteria_fraction:
        criteria = None
    answer_yes = bool(ex["label"]) != bool(negate)
    target = RATING_YES if answer_yes else RATING_NO
    dist = [1.0 if r == target else 0.0 for r in range(RATING_LEVELS)]
    return dict(
        question={"type": NOUL, "instructions": instructions, "criteria": criteria},
        target=target,
        target_dist=dist,
        n_options=2,
        band=band_of(2),
        negated=bool(negate),
        full_options=True,
        canonical=canonical and not negate,
    )


def uniform_dist(question: dict[str, Any]) -> list[float]:
    """The abstain target: uniform over the options, levels or Noul ratings the question offers."""
    if question["type"] in (CHOICE, SCORE):
        n = len(question["criteria"])
    else:
        n = RATING_LEVELS
    return [1.0 / n] * n
