"""Contamination guard: no evaluation data may reach the training mixture.

Run before anything loads. A source is refused when any of its identifiers (registry name, hub id,
config, aliases, local file names) resolves to one of the S1Bench evaluation subsets, to HWU64, or
to an evaluation file in the shared eval-data folder. Resolution is by aliases, org prefixes and
name parts (``tals/vitaminc``, ``paws-x``, ``google/boolq``, ``nvidia/HelpSteer2``,
``rajpurkar/squad_v2``, ``super_glue`` + ``boolq`` ...). Local files are also checked by content:
a renamed copy of an evaluation file is caught by its digest.

The eval-data README allows ``banking77-train.csv`` and the train / val / oos_train / oos_val parts
of ``clinc150-small.json`` for fitting; every other file there (and those parts named test) is
evaluation data.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# The 13 S1Bench evaluation subsets (by dataset), plus HWU64, with what resolves to each.
# Families are blocked whole where another version or translation shares items with the test set:
# SQuAD 2.0 contains every SQuAD 1.1 question, MASSIVE is a translation of SLURP (built on the
# HWU64 collection) in every locale, Aegis 2.0 extends Aegis 1.0, Civil Comments is the Jigsaw
# Unintended Bias data.
EVAL_SUBSETS: Mapping[str, str] = {
    "vitaminc": "S1Bench vitaminc",
    "massive": "S1Bench massive (en-US, de-DE)",
    "boolq": "S1Bench boolq",
    "helpsteer2": "S1Bench helpsteer2",
    "aegis2": "S1Bench aegis2",
    "paws": "S1Bench paws",
    "squad2": "S1Bench squad2",
    "multinli": "S1Bench multinli",
    "civil_comments": "S1Bench civil_comments",
    "summeval": "S1Bench summeval (relevance, consistency)",
    "pubmedqa": "S1Bench pubmedqa",
    "hwu64": "HWU64 (evaluation)",
}

# Patterns run on a lowercased identifier whose separators are folded to "_"; (?<![a-z0-9]) and
# (?![a-z0-9]) are word edges that treat "_" as a separator.
_L, _R = r"(?<![a-z0-9])", r"(?![a-z0-9])"
_PATTERNS: Mapping[str, tuple[str, ...]] = {
    "vitaminc": (r"vitamin_?c" + _R,),
    "massive": (_L + r"massive" + _R, r"amazon_?massive", _L + r"slurp" + _R),
    "boolq": (r"bool_?q",),
    "helpsteer2": (r"help_?steer_?v?2",),
    "aegis2": (_L + r"aegis",),
    "paws": (_L + r"paws(_?x)?" + _R,),
    "squad2": (_L + r"squad",),
    "multinli": (r"multi_?nli", _L + r"mnli"),
    "civil_comments": (r"civil_?comments", r"jigsaw_?unintended", r"unintended_?bias"),
    "summeval": (r"summ_?eval",),
    "pubmedqa": (r"pub_?med_?qa",),
    "hwu64": (_L + r"hwu(_?64)?" + _R, r"hwu_?64"),
}
_COMPILED = {k: tuple(re.compile(p) for p in v) for k, v in _PATTERNS.items()}

# What the eval-data README allows for fitting; anything else in that folder is evaluation data.
EVAL_DATA_ALLOWED_FILES: Mapping[str, tuple[str, ...] | None] = {
    "banking77-train.csv": None,
    "clinc150-small.json": ("train", "val", "oos_train", "oos_val"),
    "clinc150-domains.json": None,  # intent -> domain metadata, no rows
}
EVAL_DATA_DOCS = ("README.md", "LICENSE-banking77", "LICENSE-clinc150")
EVAL_DATA_ENV = "LEV_EVAL_DATA"
TRAIN_DATA_ENV = "LEV_TRAIN_DATA"
# The parts of the train-data folder its README marks *test* (measurement only), with the unlabelled
# test files beside them: a training source that names one is refused. (QNLI dev.tsv and DBpedia's
# train.csv are hash-split by the build; their measured part is the build's own test split.)
TRAIN_DATA_TEST_PARTS: frozenset[str] = frozenset(
    {
        "sst2/dev.tsv",
        "sst2/test.tsv",
        "sst2_sentences/stsa.binary.test",
        "sst5/stsa.fine.test",
        "snips/test/seq.in",
        "snips/test/seq.out",
        "snips/test/label",
        "commonsenseqa/dev_rand_split.jsonl",
        "commonsenseqa/test_rand_split_no_answers.jsonl",
        "arc/ARC-Easy-Dev.jsonl",
        "arc/ARC-Challenge-Dev.jsonl",
        "openbookqa/test.jsonl",
        "strategyqa/dev.json",
        "qnli/test.tsv",
        "copa/val.jsonl",
    }
)


class ContaminationError(RuntimeError):
    """A training source resolves to evaluation data."""

    def __init__(self, violations: Sequence[Violation]):
        self.violations = list(violations)
        lines = [f"  {v.source}: {v.identifier!r} -> {v.reason}" for v in self.violations]
        super().__init__(f"contamination guard refused {len(lines)} source(s):\n" + "\n".join(lines))


@dataclass(frozen=True)
class Violation:
    source: str
    identifier: str
    reason: str


def default_eval_data_dir() -> Path:
    """Where the shared eval-data folder is: ``$LEV_EVAL_DATA``, else ``<repo>/../shared/eval-data``
    (never a machine path). The one definition: the data pipeline, the guard and levbench use it."""
    env = os.environ.get(EVAL_DATA_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "eval-data"


def default_train_data_dir() -> Path:
    """Where the shared train-data folder is: ``$LEV_TRAIN_DATA``, else ``<repo>/../shared/train-data``
    (found as the eval-data folder is; never a machine path)."""
    env = os.environ.get(TRAIN_DATA_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "train-data"


def train_data_test_part(path: Path) -> str | None:
    """The train-data test part `path` is (its path relative to the folder), or None."""
    try:
        rel = path.resolve().relative_to(default_train_data_dir().resolve()).as_posix()
    except (OSError, ValueError):
        return None
    return rel if rel in TRAIN_DATA_TEST_PARTS else None


def _fold(identifier: str) -> str:
    s = re.sub(r"([a-z])([A-Z])", r"\1_\2", identifier)  # HelpSteer2 -> Help_Steer2
    s = s.lower()
    return re.sub(r"[^a-z0-9]+", "_", s)


def resolve_eval_subset(identifier: str) -> str | None:
    """The evaluation subset ``identifier`` resolves to, or None."""
    if not identifier:
        return None
    forms = {_fold(identifier), identifier.lower(), re.sub(r"[^a-z0-9]+", "_", identifier.lower())}
    for part in re.split(r"[/:\\]", identifier):  # org prefixes, configs and path parts
        if part:
            forms.add(_fold(part))
            forms.add(re.sub(r"[^a-z0-9]+", "_", part.lower()))
    for subset, patterns in _COMPILED.items():
        for form in forms:
            if any(p.search(form) for p in patterns):
                return subset
    return None


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class Guard:
    """The guard, bound to one eval-data folder (fingerprints are computed once, lazily)."""

    def __init__(self, eval_data_dir: str | os.PathLike | None = None):
        self.eval_data_dir = Path(eval_data_dir) if eval_data_dir is not None else default_eval_data_dir()
        self._fingerprints: dict[str, str] | None = None
        self._texts: set[str] | None = None

    # -- eval-data folder -------------------------------------------------------------------
    def eval_files(self) -> list[Path]:
        """Every file in the eval-data folder that is evaluation data (not on the README's allow list)."""
        return [p for p in self._data_files() if p.name not in EVAL_DATA_ALLOWED_FILES]

    def _data_files(self) -> list[Path]:
        d = self.eval_data_dir
        if not d.is_dir():
            return []
        return sorted(p for p in d.iterdir() if p.is_file() and p.name not in EVAL_DATA_DOCS)

    def fingerprints(self) -> dict[str, str]:
        """sha256 -> file name, for every data file in the eval-data folder (allowed ones too, so that
        a renamed copy of clinc150-small.json is still held to its allowed parts)."""
        if self._fingerprints is None:
            self._fingerprints = {sha256_file(p): p.name for p in self._data_files()}
        return self._fingerprints

    def _in_eval_dir(self, path: Path) -> bool:
        try:
            return self.eval_data_dir.is_dir() and path.resolve().parent == self.eval_data_dir.resolve()
        except OSError:
            return False

    def eval_texts(self) -> set[str]:
        """Normalized texts of every evaluation row in the eval-data folder (row-level decontamination)."""
        from lev_jax.data.splits import normalize_text

        if self._texts is None:
            texts: set[str] = set()
            for p in self._data_files():
                allowed = EVAL_DATA_ALLOWED_FILES.get(p.name, "missing")
                try:
                    texts.update(_file_texts(p, allowed if allowed != "missing" else None, whole=allowed == "missing"))
                except (OSError, ValueError) as e:  # skipping it would let its rows into training
                    raise ValueError(
                        f"eval-data file {p} cannot be read for decontamination: {e.__class__.__name__}: {e}"
                    ) from e
            self._texts = {t for t in (normalize_text(x) for x in texts) if len(t) >= 8}
        return self._texts

    # -- checks -----------------------------------------------------------------------------
    def check_identifier(self, identifier: str, source: str | None = None) -> list[Violation]:
        subset = resolve_eval_subset(identifier)
        if subset is None:
            return []
        return [Violation(source or identifier, identifier, f"evaluation subset {EVAL_SUBSETS[subset]}")]

    def check_path(
        self, path: str | os.PathLike, parts: Iterable[str] = (), source: str | None = None
    ) -> list[Violation]:
        """A local file: eval-data folder membership (and JSON parts), name, and content digest."""
        raw = str(path)
        archive, _, member = raw.partition("::")
        p = Path(archive)
        label = source or raw
        parts = tuple(parts)
        out: list[Violation] = []
        for ident in (p.name, member):
            if ident:
                out.extend(self.check_identifier(ident, label))
        test_part = None if member else train_data_test_part(p)
        if test_part is not None:
            out.append(Violation(label, raw, f"train-data test part {test_part} (measurement only: its README)"))
        eval_name, how = None, ""
        if not member and self._in_eval_dir(p):
            eval_name, how = p.name, "in the eval-data folder"
        elif not member and p.is_file():
            eval_name = self.fingerprints().get(sha256_file(p))
            how = f"a copy of eval-data/{eval_name}"
        if eval_name is not None:
            if eval_name in EVAL_DATA_DOCS or eval_name not in EVAL_DATA_ALLOWED_FILES:
                out.append(Violation(label, raw, f"evaluation file {eval_name} ({how})"))
            else:
                allowed = EVAL_DATA_ALLOWED_FILES[eval_name]
                if allowed is not None:
                    bad = [x for x in parts if x not in allowed] if parts else ["(all parts)"]
                    if bad:
                        out.append(
                            Violation(
                                label,
                                raw,
                                f"evaluation part(s) {', '.join(bad)} of {eval_name} "
                                f"({how}; allowed parts: {', '.join(allowed)})",
                            )
                        )
        return out

    def check_spec(
        self, spec, local_path: str | os.PathLike | None = None, parts: Iterable[str] | None = None
    ) -> list[Violation]:
        idents = [spec.name, spec.dataset, spec.hub_id, *spec.aliases]
        if spec.config:
            idents += [spec.config, f"{spec.hub_id}/{spec.config}"]
        out: list[Violation] = []
        for ident in idents:
            out.extend(self.check_identifier(ident, spec.name))
        if local_path is not None:
            out.extend(self.check_path(local_path, parts if parts is not None else (), spec.name))
        return _dedupe(out)

    def check_line(self, line: str) -> list[Violation]:
        """One line of a sources file: a registry name, a hub id (``org/name[:config]``) or a path
        (``path[#part,part]`` selects JSON parts)."""
        from lev_jax.data.registry import REGISTRY

        line = line.strip()
        if not line or line.startswith("#"):
            return []
        if line in REGISTRY:
            return self.check_spec(REGISTRY[line])
        path, _, frag = line.partition("#")
        parts = tuple(x for x in frag.split(",") if x) if frag else ()
        out = self.check_identifier(line)
        if os.path.exists(path.partition("::")[0]) or self._in_eval_dir(Path(path)):
            out.extend(self.check_path(path, parts, line))
        return _dedupe(out)

    def enforce(self, violations: Sequence[Violation]) -> None:
        if violations:
            raise ContaminationError(violations)


def _dedupe(vs: list[Violation]) -> list[Violation]:
    seen, out = set(), []
    for v in vs:
        if (v.source, v.reason) not in seen:
            seen.add((v.source, v.reason))
            out.append(v)
    return out


def _file_texts(path: Path, allowed_parts: tuple[str, ...] | None, whole: bool) -> list[str]:
    """Text fields of the evaluation rows of one eval-data file (only its non-allowed parts)."""
    import csv
    import json

    name = path.name
    if name.endswith(".csv"):
        if not whole:
            return []
        with open(path, newline="", encoding="utf-8") as f:
            return [r.get("text", "") for r in csv.DictReader(f)]
    if name.endswith(".jsonl"):
        if not whole:
            return []
        out = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    out += [str(rec[k]) for k in ("question", "text", "passage", "sentence") if k in rec]
        return out
    if name.endswith(".json"):
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            return []
        out = []
        for part, rows in data.items():
            if allowed_parts is not None and part in allowed_parts:
                continue
            if not whole and allowed_parts is None:
                continue
            if isinstance(rows, list):
                out += [str(r[0]) for r in rows if isinstance(r, list) and r]
        return out
    return []


def check_sources_file(path: str | os.PathLike, guard: Guard | None = None) -> list[str]:
    """``python -m data check sources.txt``: raise ContaminationError or return the lines checked."""
    guard = guard or Guard()
    lines = [ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    violations: list[Violation] = []
    for ln in lines:
        violations.extend(guard.check_line(ln))
    guard.enforce(violations)
    return lines
