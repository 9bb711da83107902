"""Prompt data: where a run's prompts come from, and its train / test split.

Sources (``data.prompts``, ``data.test_prompts``):
  a list                    strings or records (dicts with the prompt column)
  FILE.txt                  one prompt per line
  FILE.jsonl / FILE.json    one JSON object per line / a JSON array of objects (or strings)
  FILE.csv / FILE.tsv       a header row, then one record per row (values are text)
  FILE.parquet              one record per row (needs pyarrow)
  DIR                       a Hugging Face ``datasets`` directory written by ``save_to_disk`` (load_from_disk)
  hf:NAME                   a dataset loaded with ``datasets.load_dataset(NAME)`` (a hub id, or a local folder
                            of data files); with HF_HUB_OFFLINE=1 only the local cache is used
  builtin:NAME              a prompt set shipped with omnirl (``omnirl_core/data/builtin/NAME.jsonl``)

A record may carry more than the prompt: media for models that read them (``image``, ``audio``, ``video``: a
path or a list of paths, relative to the file's directory) and whatever a reward compares against (e.g.
``answer``, ``text``, ``count``, an edit's ``mask``). They reach the rollout and the rewards as
``GenRequest.inputs``. ``image`` holds a prompt's condition images (an edit's source; ``data.images``): each is
checked when the data is read (a missing or unreadable file is an error naming ``file:line``), and images a dataset
holds (a Hugging Face ``Image`` feature, Parquet image bytes) are written to the cache and named by path.

The split, first that applies: ``data.test_prompts`` (a second source) is the test set; a dataset with named
splits (``data.train_split`` / ``data.test_split``), or records with a split column (``data.split_column``)
holding those names; ``data.test_fraction`` of the distinct prompts held out with ``data.split_seed``;
otherwise there is no test set. Train and test never share a prompt text.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnirl_core.contracts.data import MEDIA_KEYS
from omnirl_core.data.images import condition_field
from omnirl_core.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    from omnirl_core.config import DataSection
    from omnirl_core.resolve import ResolvedRun

log = logging.getLogger("omnirl")

BUILTIN = "builtin:"
HF = "hf:"
FILE_SUFFIXES = (".txt", ".jsonl", ".json", ".csv", ".tsv", ".parquet")
HF_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")

Records = list[dict[str, Any]]


class NoPromptsError(ConfigError):
    """No prompt source at all: data.prompts unset and no reward suggests prompts."""


def _media_paths(record: dict[str, Any], base: Path, where: str) -> dict[str, Any]:
    """Media paths relative to the data file's directory, made absolute (URLs and absolute paths kept); condition
    images (``image``) checked, ``where`` naming the record in errors (``data.images``)."""

    def fix(value: object) -> object:
        if isinstance(value, list):
            return [fix(v) for v in value]
        if isinstance(value, str) and "://" not in value and not Path(value).is_absolute():
            return str(base / value)
        return value

    return condition_field({k: fix(v) if k in MEDIA_KEYS else v for k, v in record.items()}, where)


def _check_prompt(record: dict[str, Any], where: str, column: str = "prompt") -> None:
    prompt = record.get(column)
    if not isinstance(prompt, str) or not prompt.strip():
        got = f"no '{column}' key" if column not in record else f"'{column}' is {prompt!r}"
        raise ConfigError(f"{where}: a record needs a non-empty text '{column}' ({got}).",
                          hint="Give every record a prompt string, or remove the record.")


def _missing_column(where: str, column: str, columns: list[str]) -> ConfigError:
    return ConfigError(
        f"{where}: no prompt column '{column}'.{did_you_mean(column, columns)} Columns: {', '.join(columns) or 'none'}.",
        hint="Name the column that holds the prompts with data.prompt_column=NAME.",
    )


# -- readers: a source -> records (or records per named split) ---------------------------------------

def builtin_sets() -> list[str]:
    """The names of the prompt sets shipped with omnirl (``builtin:NAME``)."""
    folder = resources.files("omnirl_core.data") / "builtin"
    return sorted(p.name.removesuffix(".jsonl") for p in folder.iterdir() if p.name.endswith(".jsonl"))


def _builtin_path(name: str) -> Path:
    path = Path(str(resources.files("omnirl_core.data") / "builtin" / f"{name}.jsonl"))
    if not path.is_file():
        known = builtin_sets()
        raise ConfigError(f"Unknown built-in prompt set 'builtin:{name}'.{did_you_mean(name, known)} "
                          f"Built-in sets: {', '.join(known)}.", hint="Pick one of them, e.g. builtin:colors.")
    return path


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {exc.start}: {exc.reason}).",
                          hint="Save the prompt file as UTF-8 (e.g. iconv -t UTF-8).") from None


def _read_jsonl(path: Path, column: str) -> Records:
    records = []
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{n}: not valid JSON ({exc.msg}).") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{path}:{n}: expected a JSON object with a '{column}' key, got "
                              f"{type(record).__name__}.")
        _check_prompt(record, f"{path}:{n}", column)
        records.append(_media_paths(record, path.parent, f"{path}:{n}"))
    return records


def _read_json(path: Path, column: str) -> Records:
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg}).") from None
    if not isinstance(data, list):
        raise ConfigError(f"{path}: expected a JSON array of records or strings, got {type(data).__name__}.",
                          hint="For one object per line, name the file .jsonl.")
    records = []
    for n, item in enumerate(data):
        record = {column: item} if isinstance(item, str) else item
        if not isinstance(record, dict):
            raise ConfigError(f"{path}: item {n}: expected an object or a string, got {type(item).__name__}.")
        _check_prompt(record, f"{path}: item {n}", column)
        records.append(_media_paths(record, path.parent, f"{path}: item {n}"))
    return records


def _read_csv(path: Path, column: str) -> Records:
    reader = csv.reader(_read_text(path).splitlines(), delimiter="\t" if path.suffix == ".tsv" else ",")
    try:
        header = next(reader, None)
        if header is None:
            return []
        header = [h.strip().lstrip("\ufeff") for h in header]
        if column not in header:
            raise _missing_column(f"{path}:1", column, header)
        records = []
        for row in reader:
            if not any(cell.strip() for cell in row):
                continue
            if len(row) != len(header):
                raise ConfigError(f"{path}:{reader.line_num}: expected {len(header)} fields (the header's), got "
                                  f"{len(row)}.", hint="Quote fields that contain the delimiter (\"a, b\").")
            record = dict(zip(header, row))
            _check_prompt(record, f"{path}:{reader.line_num}", column)
            records.append(_media_paths(record, path.parent, f"{path}:{reader.line_num}"))
    except csv.Error as exc:
        raise ConfigError(f"{path}:{reader.line_num}: not valid CSV ({exc}).") from None
    return records


def _read_parquet(path: Path) -> Records:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"Reading {path} needs pyarrow, which is not installed.",
                          hint="pip install pyarrow (or 'omnirl[data]').") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        raise ConfigError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc}).") from None
    return [_media_paths(r, path.parent, f"{path}: row {n + 1}") for n, r in enumerate(table.to_pylist())]


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ConfigError("Loading a Hugging Face dataset needs the 'datasets' package, which is not installed.",
                          hint="pip install datasets (or 'omnirl[data]').") from None
    return datasets


def _from_hf(data: Any, where: str) -> Records | dict[str, Records]:
    """A dataset's records (per named split for a DatasetDict), ``image`` features written to the image cache."""
    if isinstance(data, dict):  # a DatasetDict: records per named split
        return {name: [condition_field(r, f"{where} [{name}] record {n + 1}") for n, r in enumerate(split)]
                for name, split in data.items()}
    return [condition_field(r, f"{where} record {n + 1}") for n, r in enumerate(data)]


def _read_hf_disk(path: Path) -> Records | dict[str, Records]:
    datasets = _datasets()
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds for a damaged directory
        raise ConfigError(f"{path}: cannot load the Hugging Face dataset ({type(exc).__name__}: {exc}).",
                          hint="Write it with Dataset.save_to_disk / DatasetDict.save_to_disk.") from None
    return _from_hf(data, str(path))


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _read_hf_name(name: str, config: str | None) -> Records | dict[str, Records]:
    datasets = _datasets()
    try:
        data = datasets.load_dataset(name, config)
    except Exception as exc:  # noqa: BLE001 - network, cache and format errors alike reach the user
        if _offline():
            hint = ("HF_HUB_OFFLINE is set, so only the local cache is used: download the dataset once with the "
                    "network, or point data.prompts at a local copy (save_to_disk directory or files).")
        else:
            hint = ("Check the name (and data.dataset_config); without network access set HF_HUB_OFFLINE=1 to "
                    "use the local cache, or point data.prompts at a local copy.")
        raise ConfigError(f"Cannot load the dataset '{name}' with datasets.load_dataset: "
                          f"{type(exc).__name__}: {str(exc)[:300]}", hint=hint) from None
    return _from_hf(data, f"{HF}{name}")


def read_source(source: str | list[Any], column: str = "prompt", where: str = "data.prompts",
                dataset_config: str | None = None) -> Records | dict[str, Records]:
    """The records of a source, or records per split for a dataset with named splits. Every record has a
    non-empty text under ``column``; nothing is split or renamed here."""
    if isinstance(source, list):
        records = [dict(p) if isinstance(p, dict) else {column: p} for p in source]
        for n, record in enumerate(records):
            _check_prompt(record, f"{where}[{n}]", column)
            records[n] = condition_field(record, f"{where}[{n}]")
        return records
    if source.startswith(BUILTIN):
        return _read_jsonl(_builtin_path(source[len(BUILTIN):]), "prompt")
    if source.startswith(HF):
        return _read_hf_name(source[len(HF):], dataset_config)
    path = Path(source).expanduser()
    if path.is_dir():
        if not any((path / m).is_file() for m in HF_DISK_MARKERS):
            raise ConfigError(f"Directory '{source}' ({where}) is not a saved Hugging Face dataset (no "
                              f"{' / '.join(HF_DISK_MARKERS)}).",
                              hint="Pass a file, a save_to_disk directory, or hf:PATH to load a folder of data "
                              "files with datasets.load_dataset.")
        return _read_hf_disk(path)
    if not path.is_file():
        hint = "Pass a .txt (one prompt per line), .jsonl, .json, .csv, .tsv or .parquet file."
        if "/" in source and not path.suffix and not path.parent.exists():
            hint += f" For a Hugging Face dataset write hf:{source}."
        raise ConfigError(f"Prompt file '{source}' not found ({where}).", hint=hint)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path, column)
    if suffix == ".json":
        return _read_json(path, column)
    if suffix in (".csv", ".tsv"):
        return _read_csv(path, column)
    if suffix == ".parquet":
        return _read_parquet(path)
    return [{column: line.strip()} for line in _read_text(path).splitlines() if line.strip()]


def _as_prompts(records: Records, column: str, where: str) -> Records:
    """Rename the prompt column to ``prompt``; every record needs a non-empty text there."""
    if records and all(column not in r for r in records):
        raise _missing_column(where, column, sorted({k for r in records for k in r}))
    if column == "prompt":
        for n, record in enumerate(records):
            _check_prompt(record, f"{where}: record {n}", column)
        return records
    out = []
    for n, record in enumerate(records):
        _check_prompt(record, f"{where}: record {n}", column)
        rec = {k: v for k, v in record.items() if k not in (column, "prompt")}
        out.append({"prompt": record[column], **rec})
    return out


def load_records(source: str | list[Any], prompt_column: str = "prompt", dataset_config: str | None = None,
                 where: str = "data.prompts") -> Records:
    """Every prompt of a source as a record ``{"prompt": str, ...other fields}`` (all splits together)."""
    data = read_source(source, prompt_column, where, dataset_config)
    if isinstance(data, dict):
        data = [r for split in data.values() for r in split]
    if not data:
        raise ConfigError(f"No prompts ({where} is empty).", hint="Give at least one prompt.")
    return _as_prompts(data, prompt_column, where)


# -- the split --------------------------------------------------------------------------------------

@dataclass
class PromptData:
    """A run's prompts: the training records and the held-out test records (None: no test set)."""

    train: Records
    test: Records | None
    source: str
    split: str
    """How the test set was made: 'none', 'test_prompts', 'named splits', 'split column' or 'fraction'."""

    def summary(self) -> dict[str, Any]:
        columns = sorted({k for r in self.train for k in r} - {"prompt"})
        return {"source": self.source, "train": len(self.train),
                "test": len(self.test) if self.test is not None else 0, "split": self.split,
                "fields": columns}


def _describe(source: str | list[Any] | None) -> str:
    if isinstance(source, list):
        return f"a list of {len(source)}"
    return str(source)


def split_by_fraction(records: Records, fraction: float, seed: int) -> tuple[Records, Records]:
    """Hold out ``fraction`` of the distinct prompt texts (at least one), chosen with ``seed``: the same
    records and seed always give the same split, and a prompt text is never on both sides."""
    texts = sorted({r["prompt"] for r in records})
    if len(texts) < 2:
        raise ConfigError(f"data.test_fraction = {fraction:g} needs at least two distinct prompts, got "
                          f"{len(texts)}.", hint="Give more prompts, or a test set with data.test_prompts.")
    count = min(len(texts) - 1, max(1, round(len(texts) * fraction)))
    held = set(random.Random(seed).sample(texts, count))
    return [r for r in records if r["prompt"] not in held], [r for r in records if r["prompt"] in held]


def _by_column(records: Records, column: str, train_name: str, test_name: str,
               where: str) -> tuple[Records, Records]:
    train: Records = []
    test: Records = []
    other: dict[str, int] = {}
    for record in records:
        value = record.get(column)
        rec = {k: v for k, v in record.items() if k != column}
        if value == train_name:
            train.append(rec)
        elif value == test_name:
            test.append(rec)
        else:
            other[str(value)] = other.get(str(value), 0) + 1
    if other:
        log.warning("%s: %d record(s) of split(s) %s are used neither for training nor for testing "
                    "(data.train_split='%s', data.test_split='%s')", where, sum(other.values()),
                    ", ".join(sorted(other)), train_name, test_name)
    return train, test


def _test_part(data: Records | dict[str, Records], cfg: DataSection, where: str) -> Records:
    """All of a test source (its test split when it has named splits)."""
    if isinstance(data, dict):
        if cfg.test_split not in data:
            raise ConfigError(f"{where} has no split '{cfg.test_split}' (it has {', '.join(data)}).",
                              hint="Name the test split with data.test_split=NAME.")
        return data[cfg.test_split]
    if data and all(cfg.split_column in r for r in data):
        return _by_column(data, cfg.split_column, cfg.train_split, cfg.test_split, where)[1]
    return data


def load_data(cfg: DataSection, default_prompts: list[Any] | str | None = None, default_name: str = "") -> PromptData:
    """Open and check a run's prompt data (``cfg``: the config's ``data`` section). ``default_prompts``: what
    the run uses when ``data.prompts`` is unset (the first reward's suggested prompts: a list, or a shipped set's
    ``builtin:NAME``)."""
    column = cfg.prompt_column
    source = cfg.prompts
    if source is None:
        if default_prompts is None:
            raise NoPromptsError("No prompts: set data.prompts (a file, builtin:NAME, hf:NAME or a list).",
                              hint="Example: --set data.prompts=prompts.txt (built-in sets: "
                              f"{', '.join('builtin:' + n for n in builtin_sets())})")
        source = default_prompts if isinstance(default_prompts, str) else list(default_prompts)
        column = "prompt"
        described = f"the suggested prompts of {default_name or 'the reward'}"
        if isinstance(default_prompts, str):
            described = f"{default_prompts}, suggested by {default_name or 'the reward'}"
    else:
        described = _describe(source)
        if isinstance(source, str) and source.startswith(BUILTIN):
            column = "prompt"  # the shipped sets name their column so
    data = read_source(source, column, "data.prompts", cfg.dataset_config)
    test: Records | None = None
    how = "none"
    if isinstance(data, dict):
        if cfg.train_split not in data:
            raise ConfigError(f"data.prompts ({described}) has no split '{cfg.train_split}' (it has "
                              f"{', '.join(data)}).", hint="Name the training split with data.train_split=NAME.")
        train = data[cfg.train_split]
        if cfg.test_split in data:
            test, how = data[cfg.test_split], "named splits"
    elif data and all(cfg.split_column in r for r in data):
        train, test = _by_column(data, cfg.split_column, cfg.train_split, cfg.test_split, "data.prompts")
        how = "split column"
    else:
        train = data
    if cfg.test_prompts is not None:
        raw = read_source(cfg.test_prompts, cfg.prompt_column, "data.test_prompts", cfg.dataset_config)
        test, how = _test_part(raw, cfg, "data.test_prompts"), "test_prompts"
        if not test:
            raise ConfigError(f"No test prompts (data.test_prompts = {_describe(cfg.test_prompts)} is empty).",
                              hint="Give at least one prompt, or unset data.test_prompts.")
        test = _as_prompts(test, cfg.prompt_column, "data.test_prompts")
    if not train:
        raise ConfigError(f"No prompts (data.prompts = {described} is empty"
                          f"{'' if how in ('none', 'test_prompts') else ' in its training split'}).",
                          hint="Give at least one prompt.")
    train = _as_prompts(train, column, "data.prompts")
    if cfg.test_fraction > 0:
        if how != "none":
            raise ConfigError(f"data.test_fraction = {cfg.test_fraction:g}, but the data already has a test set "
                              f"({how}).", hint="Unset data.test_fraction, or drop the other test set.")
        train, test = split_by_fraction(train, cfg.test_fraction, cfg.split_seed)
        how = "fraction"
    elif how in ("named splits", "split column"):
        if not test:
            log.warning("data.prompts: the split '%s' is empty: no test set", cfg.test_split)
            test, how = None, "none"
        else:
            test = _as_prompts(test, column, "data.prompts")
    if test is not None:
        shared = {r["prompt"] for r in train} & {r["prompt"] for r in test}
        if shared and how == "test_prompts":
            log.warning("%d prompt(s) are in both the training data and data.test_prompts (e.g. %r)",
                        len(shared), min(shared))
    return PromptData(train=train, test=test, source=described, split=how)


class PromptSampler:
    """Deterministic per step: the prompts of step k depend only on (seed, k), so a resumed run sees
    exactly the prompts it would have seen."""

    def __init__(self, prompts: list[str], seed: int):
        self.prompts = prompts
        self.seed = seed

    def draw(self, step: int, count: int) -> list[tuple[int, str]]:
        rng = random.Random(self.seed * 1_000_003 + step)
        if count <= len(self.prompts):
            idx = rng.sample(range(len(self.prompts)), count)
        else:
            idx = [rng.randrange(len(self.prompts)) for _ in range(count)]
        return [(i, self.prompts[i]) for i in idx]


def open_run_data(resolved: ResolvedRun) -> PromptData:
    """The prompt data of a resolved run: ``data.prompts``, or the first reward's suggested prompts (strings or
    records; records with a ``split`` column hold their own test set, as the colour reward's do: the main job's run
    is evaluated on them)."""
    from omnirl_core.registry import load_object

    default: list[Any] | str | None = None
    name = ""
    if resolved.config.data.prompts is None:
        for spec in resolved.rewards:
            ref = spec.default_prompts
            if ref is not None:
                default = ref if isinstance(ref, str) and ref.startswith(BUILTIN) else list(load_object(ref))
                name = f"reward '{spec.name}'"
                break
    data = load_data(resolved.config.data, default, name)
    check_reward_fields(resolved, data)
    check_media_fields(resolved, data)
    if resolved.config.run.eval_every is not None and not data.test:
        raise ConfigError(f"run.eval_every = {resolved.config.run.eval_every}, but the prompts ({data.source}) have "
                          "no test split to evaluate on.",
                          hint="Give held-out prompts: data.test_prompts=FILE, data.test_fraction=0.1, or a data "
                          "set with a test split (e.g. data.prompts=builtin:colors).")
    return data


MEDIA_FIELDS = {"image": "image-input", "audio": "audio-input", "video": "video-input"}
"""Prompt-record fields that hold media the model reads, and the model capability that reads them."""


def check_media_fields(resolved: ResolvedRun, data: PromptData) -> None:
    """A record with an image, audio or video input needs a model that reads that input: otherwise the
    model would ignore it without a word."""
    read_by_rewards = {f for spec in resolved.rewards if not isinstance(spec.input_fields, str)
                       for f in spec.input_fields}
    for field, capability in MEDIA_FIELDS.items():
        if capability in resolved.model.capabilities or field in read_by_rewards:
            continue
        for split, records in (("train", data.train), ("test", data.test or [])):
            first = next((n for n, record in enumerate(records) if record.get(field) not in (None, "", [])), None)
            if first is not None:
                raise ConfigError(
                    f"The prompt data ({data.source}) has '{field}' inputs ({split} record {first + 1}, prompt "
                    f"{records[first]['prompt'][:50]!r}), but model '{resolved.model.name}' does not read {field} "
                    "inputs.", hint=f"Pick a model with the '{capability}' capability (see `omnirl list models`), "
                    f"or remove the '{field}' field from the data.")


def check_reward_fields(resolved: ResolvedRun, data: PromptData) -> None:
    """Every record (train and test) holds the fields the run's rewards read (``RewardSpec.input_fields``)."""
    from omnirl_core.registry import load_object

    problems = []
    for i, spec in enumerate(resolved.rewards):
        fields = spec.input_fields
        if isinstance(fields, str):
            fields = load_object(fields)(resolved.options.get(f"rewards.{i}.options"))
        for field in fields:
            for split, records in (("train", data.train), ("test", data.test or [])):
                missing = [n for n, record in enumerate(records) if record.get(field) is None]
                if missing:
                    problems.append(f"  reward '{spec.name}' reads the field '{field}', which {len(missing)} of "
                                    f"{len(records)} {split} record(s) lack (the first: record {missing[0] + 1}, "
                                    f"prompt {records[missing[0]]['prompt'][:50]!r})")
    if problems:
        raise ConfigError(f"The prompt data ({data.source}) lacks fields the rewards need.", details=problems,
                          hint="Add the fields to every record (a .jsonl key or a column), or pick other rewards.")
