"""Condition images (an edit's source) from the data to the trainer: records name them by path (relative to the
file) or hold them (Parquet bytes, a Hugging Face ``Image`` feature: written to the cache), each checked when the data
is read (``file:line``, exit code 2 at ``--dry-run``); the shipped ``builtin:edits`` set; the typed request field;
conditionings of other layouts never concatenated; the embedding cache keyed per (prompt, images); the trainer's
velocity one call per layout."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from PIL import Image

from omnirl_core.config import DataSection
from omnirl_core.contracts import Conditioning, FlowModel, GenRequest, RolloutPlan
from omnirl_core.data.sources import load_data, load_records
from omnirl_core.errors import ConfigError
from omnirl_core.flow.batching import grouped_velocity
from omnirl_core.flow.embedding_cache import EmbeddingCache

from .conftest import run_cli


def _image(path: Path, size=(8, 8), colour=(255, 0, 0)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def test_paths_are_relative_to_the_file_and_reach_the_request(tmp_path: Path):
    _image(tmp_path / "img" / "a.png")
    _image(tmp_path / "img" / "b.png", colour=(0, 0, 255))
    rows = [{"prompt": "make it blue", "image": "img/a.png", "mask": "img/a.png"},
            {"prompt": "combine them", "image": ["img/a.png", "img/b.png"]}, {"prompt": "no source"}]
    (tmp_path / "edits.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = load_records(str(tmp_path / "edits.jsonl"))
    assert records[0]["image"] == str(tmp_path / "img" / "a.png") and records[0]["mask"] == records[0]["image"]
    assert records[1]["image"] == [str(tmp_path / "img" / "a.png"), str(tmp_path / "img" / "b.png")]
    plan = RolloutPlan(step_kinds=("ode",), train_steps=())
    requests = [GenRequest(uid=i, prompt=r["prompt"], prompt_index=i, group=i, seed=0, height=8, width=8, plan=plan,
                           inputs={k: v for k, v in r.items() if k != "prompt"}) for i, r in enumerate(records)]
    assert [len(r.condition_images) for r in requests] == [1, 2, 0]
    assert requests[1].condition_images[1].endswith("b.png")


@pytest.mark.parametrize(("content", "message"), [
    (None, "condition image '{path}' not found"),
    (b"not an image", "condition image '{path}' is not a readable image"),
])
def test_a_missing_or_unreadable_image_names_the_file_and_line(tmp_path: Path, content, message):
    bad = tmp_path / "bad.png"
    if content is not None:
        bad.write_bytes(content)
    _image(tmp_path / "ok.png")
    data = tmp_path / "edits.jsonl"
    data.write_text(json.dumps({"prompt": "fine", "image": "ok.png"}) + "\n"
                    + json.dumps({"prompt": "broken", "image": ["ok.png", "bad.png"]}) + "\n")
    with pytest.raises(ConfigError) as info:
        load_records(str(data))
    assert info.value.message.startswith(f"{data}:2: " + message.format(path=bad))
    csv = tmp_path / "edits.csv"
    csv.write_text("prompt,image\nfine,ok.png\nbroken,bad.png\n")
    with pytest.raises(ConfigError, match=re.escape(f"{csv}:3: ")):
        load_records(str(csv))


def test_dry_run_refuses_a_missing_source_with_exit_code_2(tmp_path: Path):
    data = tmp_path / "edits.jsonl"
    data.write_text(json.dumps({"prompt": "make it red", "image": "gone.png"}) + "\n")
    out = tmp_path / "run"
    proc = run_cli("train", "--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny", "--set",
                   f"data.prompts={data}", "--output-dir", str(out), "--dry-run")
    assert proc.returncode == 2, proc.stderr
    assert f"{data}:1: condition image '{tmp_path / 'gone.png'}' not found." in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_images_a_dataset_holds_are_written_to_the_cache(tmp_path: Path, monkeypatch):
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setenv("OMNIRL_CACHE", str(tmp_path / "cache"))
    buffer = io.BytesIO()
    Image.new("RGB", (6, 4), (0, 255, 0)).save(buffer, format="PNG")
    pq.write_table(pa.Table.from_pylist([{"prompt": "make it red", "image": {"bytes": buffer.getvalue(),
                                                                             "path": "src.png"}}]),
                   tmp_path / "edits.parquet")
    [record] = load_records(str(tmp_path / "edits.parquet"))
    cached = Path(record["image"])
    assert cached.parent == tmp_path / "cache" / "images" and cached.read_bytes() == buffer.getvalue()
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    features = datasets.Features({"prompt": datasets.Value("string"), "image": datasets.Image()})
    dataset = datasets.Dataset.from_dict({"prompt": ["make it blue"], "image": [Image.new("RGB", (5, 5), (9, 9, 9))]},
                                         features=features)
    dataset.save_to_disk(str(tmp_path / "hf-set"))
    [record] = load_records(str(tmp_path / "hf-set"))
    with Image.open(record["image"]) as image:
        assert image.size == (5, 5) and image.convert("RGB").getpixel((0, 0)) == (9, 9, 9)


def test_builtin_edits_pairs_instructions_with_their_sources():
    data = load_data(DataSection(prompts="builtin:edits"))
    records = data.train + (data.test or [])
    assert len(records) == 320 and len(data.test or []) >= 40 and data.split == "split column"
    palette = {"red", "green", "blue", "yellow", "cyan", "magenta", "orange", "purple", "white", "black", "gray"}
    for record in records:
        named = [w for w in re.findall(r"[a-z]+", record["prompt"]) if w in palette]
        assert named == [record["color"]], record  # the instruction names the target colour, and only it
        assert Path(record["image"]).is_file() and Path(record["mask"]).is_file()
        assert record["source_color"] != record["color"]
    with Image.open(records[0]["image"]) as source, Image.open(records[0]["mask"]) as mask:
        x0, y0, x1, y1 = records[0]["box"]
        cx, cy = (x0 + x1) // 2, (y0 + y1) // 2
        assert mask.getpixel((cx, cy)) == 255 and mask.getpixel((0, 0)) == 0
        assert source.convert("RGB").getpixel((cx, cy)) != source.convert("RGB").getpixel((0, 0))


def test_conditionings_of_other_layouts_never_concatenate():
    a = Conditioning({"x": torch.ones(1, 3), "e": torch.ones(1, 2, 4)}, ("e",), layout=((2, 2),))
    b = Conditioning({"x": torch.ones(1, 3), "e": torch.ones(1, 5, 4)}, ("e",), layout=((2, 2),))
    c = Conditioning({"x": torch.ones(1, 3), "e": torch.ones(1, 2, 4)}, ("e",), layout=((1, 4),))
    assert a.signature == b.signature != c.signature  # padded lengths may differ, layouts may not
    assert Conditioning.cat([a, b]).layout == ((2, 2),) and Conditioning.cat([a, b]).select([1]).layout == ((2, 2),)
    with pytest.raises(ValueError, match="different layouts"):
        Conditioning.cat([a, c])


class _Recorder(FlowModel):
    """A stand-in model: velocity = latents x the conditioning's first value; records each call's layout."""

    condition_images = 1
    device = torch.device("cpu")

    def __init__(self):
        self.calls: list[tuple[int, object]] = []
        self.encoded: list[list[tuple[str, tuple[str, ...]]]] = []

    def encode(self, prompts):
        return Conditioning({"v": torch.tensor([[float(len(p))] for p in prompts])})

    def encode_with_images(self, prompts, images):
        self.encoded.append(list(zip(prompts, (tuple(i) for i in images))))
        return [Conditioning({"v": torch.tensor([[float(len(p) + len(i))]])}, layout=tuple(i) or None)
                for p, i in zip(prompts, images)]

    def velocity(self, latents, sigma, cond, guidance_scale=1.0, uncond=None):
        self.calls.append((len(cond), cond.layout))
        return latents * cond.tensors["v"][:, :, None]

    latent_shape = sigmas = decode = setup_training = trained_modules = trainable_parameters = None  # type: ignore
    reference = trained_state_dict = load_trained_state_dict = save_trained = load_trained = None  # type: ignore


def test_the_cache_keys_each_prompt_with_its_images_and_velocity_runs_per_layout():
    model = _Recorder()
    cache = EmbeddingCache(model)
    images = [("a.png",), ("a.png",), ("b.png", "c.png"), ()]
    rows = cache.lookup(["edit", "edit", "edit", "edit"], images)
    assert model.encoded == [[("edit", ("a.png",)), ("edit", ("b.png", "c.png")), ("edit", ())]]
    assert rows[0] is rows[1] and [r.layout for r in rows] == [("a.png",), ("a.png",), ("b.png", "c.png"), None]
    cache.lookup(["edit", "other"], [("a.png",), ("a.png",)])
    assert model.encoded[-1] == [("other", ("a.png",))] and cache.stats.hits == 1
    x = torch.ones(4, 2, 3)
    v = grouped_velocity(model, x, torch.ones(4), rows)
    assert model.calls == [(2, ("a.png",)), (1, ("b.png", "c.png")), (1, None)]  # groups in order of first row
    assert v[:, 0, 0].tolist() == [5.0, 5.0, 6.0, 4.0]  # each row with its own conditioning, in order
    model.calls.clear()
    grouped_velocity(model, x[:2], torch.ones(2), rows[:2])
    assert model.calls == [(2, ("a.png",))]  # one layout: the one call a text-to-image batch always made
