"""Prompt data: every source format, the train / test split, the shipped prompt sets, and bad inputs as clear
errors at ``--dry-run`` (exit code 2) before anything is written."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from omnirl_core.config import DataSection
from omnirl_core.data.sources import builtin_sets, load_data, load_records, split_by_fraction
from omnirl_core.errors import ConfigError

from .conftest import run_cli

ROWS = [{"prompt": f"a red thing number {i}", "answer": str(i)} for i in range(10)]


def _data(**kw) -> DataSection:
    return DataSection(**kw)


def _write_csv(path: Path, rows: list[dict], delimiter: str = ",") -> Path:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]), delimiter=delimiter)
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_every_file_format_loads_the_same_records(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    js = tmp_path / "p.json"
    js.write_text(json.dumps(ROWS))
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    sources = [jsonl, js, _write_csv(tmp_path / "p.csv", ROWS), _write_csv(tmp_path / "p.tsv", ROWS, "\t"), parquet]
    for source in sources:
        assert load_records(str(source)) == ROWS, source
    txt = tmp_path / "p.txt"
    txt.write_text("\n".join(r["prompt"] for r in ROWS) + "\n\n")
    assert load_records(str(txt)) == [{"prompt": r["prompt"]} for r in ROWS]


def test_hugging_face_datasets_from_disk_and_by_name(tmp_path: Path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    rows = [{"caption": r["prompt"], "answer": r["answer"]} for r in ROWS]
    single = tmp_path / "single"
    datasets.Dataset.from_list(rows).save_to_disk(str(single))
    data = load_data(_data(prompts=str(single), prompt_column="caption", test_fraction=0.2))
    assert len(data.train) == 8 and len(data.test) == 2 and data.split == "fraction"
    assert data.train[0].keys() == {"prompt", "answer"}  # the prompt column renamed, the rest kept
    both = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:7]),
                          "test": datasets.Dataset.from_list(rows[7:])}).save_to_disk(str(both))
    data = load_data(_data(prompts=str(both), prompt_column="caption"))
    assert [r["prompt"] for r in data.test] == [r["caption"] for r in rows[7:]] and data.split == "named splits"
    # a dataset name: datasets.load_dataset on a local folder of data files works offline
    folder = tmp_path / "named"
    folder.mkdir()
    _write_csv(folder / "train.csv", ROWS[:6])
    _write_csv(folder / "test.csv", ROWS[6:])
    data = load_data(_data(prompts=f"hf:{folder}"))
    assert len(data.train) == 6 and len(data.test) == 4
    # (a name that is not in the cache, offline: test_bad_data_is_a_clear_error_at_dry_run)


def test_fraction_split_is_disjoint_and_reproducible():
    records = [{"prompt": f"p{i}"} for i in range(50)] + [{"prompt": "p3", "dup": True}]
    train, test = split_by_fraction(records, 0.2, seed=0)
    assert len({r["prompt"] for r in test}) == 10
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}  # a duplicated text stays on one side
    assert (train, test) == split_by_fraction(records, 0.2, seed=0)
    assert test != split_by_fraction(records, 0.2, seed=1)[1]


def test_split_column_test_file_and_builtin_sets(tmp_path: Path):
    rows = [{**r, "split": "test" if i % 4 == 0 else "train"} for i, r in enumerate(ROWS)]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_data(_data(prompts=str(path)))
    assert [r["answer"] for r in data.test] == ["0", "4", "8"] and "split" not in data.train[0]
    other = tmp_path / "t.txt"
    other.write_text("held out one\nheld out two\n")
    data = load_data(_data(prompts=[r["prompt"] for r in ROWS], test_prompts=str(other)))
    assert len(data.train) == 10 and [r["prompt"] for r in data.test] == ["held out one", "held out two"]
    with pytest.raises(ConfigError, match="already has a test set"):
        load_data(_data(prompts=str(path), test_fraction=0.5))
    assert builtin_sets() == ["colors", "composition", "counting", "edits", "speech", "text"]
    for name in builtin_sets():
        data = load_data(_data(prompts=f"builtin:{name}"))
        assert len(data.train) + len(data.test) >= 250 and len(data.test) >= 40, name
        assert not {r["prompt"] for r in data.train} & {r["prompt"] for r in data.test}
    counting = load_data(_data(prompts="builtin:counting"))
    assert {"count", "object"} <= counting.train[0].keys()
    # a reward may suggest a shipped set (the speech rewards: builtin:speech): its own split, as if given
    suggested = load_data(_data(), "builtin:speech", "reward 'speech-signal'")
    given = load_data(_data(prompts="builtin:speech"))
    assert suggested.train == given.train and suggested.test == given.test and len(suggested.test) >= 40
    assert suggested.source == "builtin:speech, suggested by reward 'speech-signal'"


def test_shipped_sets_are_what_the_generator_writes():
    import importlib.util

    folder = Path(__file__).resolve().parents[1] / "src" / "omnirl_core" / "data" / "builtin"
    spec = importlib.util.spec_from_file_location("make_sets", folder / "make_sets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in module.SETS:
        assert (folder / f"{name}.jsonl").read_text() == module.render(name), name
    import numpy as np
    from PIL import Image

    for record in module.edits():  # the pictures and masks, pixel for pixel (PNG bytes follow the zlib version)
        for drawn, name in zip(module.draw_edit(record), ("image", "mask")):
            assert np.array_equal(np.asarray(Image.open(folder / record[name])), np.asarray(drawn)), record[name]


BASE = ["train", "--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny"]


@pytest.mark.parametrize(("name", "content", "extra", "message"), [
    ("missing.txt", None, [], "Prompt file '{path}' not found (data.prompts)"),
    ("empty.txt", b"\n\n", [], "No prompts (data.prompts = {path} is empty)"),
    ("caption.csv", b"caption,answer\na cat,1\n", [], "{path}:1: no prompt column 'prompt'. Columns: caption, answer"),
    ("caption.csv", b"caption,answer\na cat,1\n", ["--set", "data.prompt_column=captoin"],
     "no prompt column 'captoin'. Did you mean 'caption'?"),
    ("broken.csv", b"prompt,answer\na cat,1\na dog,2,extra\n", [], "{path}:3: expected 2 fields (the header's), got 3"),
    ("broken.jsonl", b'{"prompt": "a cat"}\n{"prompt": \n', [], "{path}:2: not valid JSON"),
    ("split.jsonl", b'{"prompt": "a", "split": "test"}\n', [], "in its training split"),
    ("ok.txt", b"a cat\n", ["--set", "data.test_prompts=/nonexistent/t.txt"],
     "Prompt file '/nonexistent/t.txt' not found (data.test_prompts)"),
    ("ok.txt", b"a cat\n", ["--set", "data.prompts=hf:omnirl-tests/nothing"], "HF_HUB_OFFLINE is set"),
])
def test_bad_data_is_a_clear_error_at_dry_run(tmp_path: Path, name, content, extra, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    out = tmp_path / "run"
    proc = run_cli(*BASE, "--set", f"data.prompts={path}", *extra, "--output-dir", str(out), "--dry-run",
                   env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2, proc.stderr
    assert message.format(path=path) in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()  # nothing written


def test_dry_run_reports_the_data_it_opened(tmp_path: Path):
    proc = run_cli(*BASE, "--set", "data.prompts=builtin:colors", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "source: builtin:colors" in proc.stdout and "split: split column" in proc.stdout
    assert "test: 83" in proc.stdout
