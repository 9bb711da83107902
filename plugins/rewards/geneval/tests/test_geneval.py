"""GenEval-style reward: GenEval metadata and template prompts read into checks; GenEval's relative-position
formula (written out independently here, as in the paper's evaluation script) and decision rules on
hand-made detections; the OWLv2 path (boxes in image pixels from the raw model outputs, per-class NMS) and
the CLIP colour classifier on a tiny random checkpoint; missing weights; a tiny run whose reward rises."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omnirl_plugin_geneval.judge import Detection, judge, relations
from omnirl_plugin_geneval.parse import PromptError, Task, Want, from_metadata, from_prompt, task_of
from omnirl_plugin_geneval.reward import GenEval, GenEvalOptions, nms, tiny_detector_directory

from omnirl_core.errors import UsageError
from omnirl_core.testing import check_reward_rises


def test_metadata_records_and_template_prompts():
    record = {"tag": "position", "prompt": "a photo of a dog right of a cat",
              "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["right of", 0]}]}
    expected = Task((Want("cat"), Want("dog", 1, None, ("right of", 0))), (), "position")
    assert from_metadata(record) == expected
    assert from_prompt(record["prompt"]) == expected
    assert task_of("anything", record) == expected
    assert from_prompt("a photo of three knives") == Task((Want("knife", 3),), (Want("knife", 4),), "counting")
    assert from_prompt("a photo of a red cat and a blue dog").include == (Want("cat", 1, "red"), Want("dog", 1, "blue"))
    assert from_prompt("A photo of a purple wine glass.").include == (Want("wine glass", 1, "purple"),)
    assert from_prompt("a photo of a tv remote and a cell phone").tag == "two_object"
    assert from_prompt("a photo of four people").include == (Want("person", 4),)
    with pytest.raises(PromptError, match="'unicorn' .* is not a COCO class"):
        from_prompt("a photo of a unicorn")
    with pytest.raises(PromptError, match="follows none of GenEval's templates"):
        from_prompt("sunset over the sea, oil painting")
    with pytest.raises(PromptError, match=r"include\[0\].position refers to include\[3\]"):
        from_metadata({"include": [{"class": "cat", "position": ["above", 3]}]})
    with pytest.raises(PromptError, match="is not one of GenEval's colours"):
        from_metadata({"include": [{"class": "cat", "color": "teal"}]})


def geneval_relative_position(box_a, box_b, threshold=0.1):
    """GenEval's relative_position, as its evaluation script computes it (numpy, boxes x0 y0 x1 y1)."""
    boxes = np.array([box_a, box_b], dtype=np.float64).reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=-2)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = center_a - center_b
    revised = np.maximum(np.abs(offset) - threshold * (dim_a + dim_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    out = set()
    if dx < -0.5:
        out.add("left of")
    if dx > 0.5:
        out.add("right of")
    if dy < -0.5:
        out.add("above")
    if dy > 0.5:
        out.add("below")
    return out


def test_relative_position_equals_genevals_formula():
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(2000):
        a = np.sort(rng.uniform(0, 100, (2, 2)), axis=0).T.reshape(-1)[[0, 2, 1, 3]]
        b = np.sort(rng.uniform(0, 100, (2, 2)), axis=0).T.reshape(-1)[[0, 2, 1, 3]]
        got = relations(Detection("x", tuple(a), 1.0), Detection("y", tuple(b), 1.0))
        assert got == geneval_relative_position(a, b)
        seen |= got
    assert seen == {"left of", "right of", "above", "below"}


def _d(cls, x0, y0, x1, y1, score=0.9):
    return Detection(cls, (x0, y0, x1, y1), score)


def test_decision_rules():
    cat_left, dog_right = _d("cat", 0, 0, 10, 10), _d("dog", 30, 0, 40, 10)
    position = from_prompt("a photo of a dog right of a cat")
    assert judge(position, [cat_left, dog_right]) == (True, 1.0)
    assert judge(position, [_d("cat", 30, 0, 40, 10), _d("dog", 0, 0, 10, 10)]) == (False, 2 / 3)
    assert judge(position, [dog_right]) == (False, 1 / 3)  # no cat: nothing for the dog to be right of
    counting = from_prompt("a photo of two cats")
    assert judge(counting, [cat_left, _d("cat", 50, 50, 60, 60)]) == (True, 1.0)
    assert judge(counting, [cat_left] * 3) == (False, 0.5)  # three: the exclude (< 3) fails
    assert judge(counting, [cat_left]) == (False, 0.5)
    colour = from_prompt("a photo of a red cat and a blue dog")
    painted = {"cat": ["red"], "dog": ["green"]}
    calls = []

    def colors_of(cls, found):
        calls.append((cls, len(found)))
        return painted[cls][: len(found)]

    assert judge(colour, [cat_left, _d("cat", 0, 0, 5, 5, 0.1), dog_right], colors_of) == (False, 3 / 4)
    assert calls == [("cat", 1), ("dog", 1)]  # the most confident cat only (count 1)


def test_nms_keeps_the_most_confident_of_overlapping_boxes():
    boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 10, 10], [20, 20, 30, 30], [0, 0, 10, 9]], dtype=torch.float32)
    scores = torch.tensor([0.5, 0.9, 0.6, 0.7])
    assert nms(boxes, scores, 0.5, 16) == [1, 2]
    assert nms(boxes, scores, 1.0, 16) == [1, 3, 2, 0]
    assert nms(boxes, scores, 0.5, 1) == [1]


@pytest.fixture(scope="module")
def tiny() -> GenEval:
    return GenEval(GenEvalOptions(preset="tiny", device="cpu", threshold=0.52, nms_iou=1.0, max_objects=1000))


def test_detections_are_the_models_boxes_in_image_pixels(tiny: GenEval):
    from PIL import Image

    image = torch.rand(3, 24, 40, generator=torch.Generator().manual_seed(0))
    found = tiny.detect(image, ["cat", "dog"], 0.52)
    # independently: the model's raw outputs, sigmoid logits, (cx, cy, w, h) relative to the padded square
    u8 = (image.clamp(0, 1) * 255).round().to(torch.uint8)
    inputs = tiny.processor(text=[["a photo of a cat", "a photo of a dog"]],
                            images=Image.fromarray(u8.permute(1, 2, 0).numpy()), return_tensors="pt")
    with torch.no_grad():
        out = tiny.detector(**inputs)
    probs = out.logits[0].sigmoid()  # (patches, 2)
    score, label = probs.max(-1)
    cx, cy, w, h = out.pred_boxes[0].unbind(-1)
    side = 40
    boxes = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1) * side
    expected = sorted((["cat", "dog"][int(label[i])], tuple(round(float(v), 3) for v in boxes[i]),
                       round(float(score[i]), 5)) for i in range(len(score)) if score[i] > 0.52)
    got = sorted((d.cls, tuple(round(v, 3) for v in d.box), round(d.score, 5)) for d in found)
    assert got == expected and len(got) > 0


def test_colours_are_clips_zero_shot_choice_on_the_crop(tiny: GenEval):
    from omnirl_core.rewards_kit.clip import to_uint8

    image = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(1))
    dets = [_d("cat", 2, 3, 20, 30), _d("cat", 10, 10, 32, 32)]
    got = tiny.colors(image, "cat", dets)
    model, pre = tiny.clip.model, tiny.clip.preprocess
    from omnirl_plugin_geneval.parse import COLORS

    tok = tiny.clip.processor.tokenizer([f"a photo of a {c} cat" for c in COLORS], padding=True, return_tensors="pt")
    with torch.no_grad():
        t = model.get_text_features(**tok)
        t = F.normalize(getattr(t, "pooler_output", t), dim=-1)
        crops = [image[:, 3:30, 2:20], image[:, 10:32, 10:32]]
        e = model.get_image_features(pixel_values=pre([to_uint8(c).float() / 255 for c in crops]))
        e = F.normalize(getattr(e, "pooler_output", e), dim=-1)
    assert got == [COLORS[i] for i in (e @ t.T).argmax(-1).tolist()]


def test_scores_and_modes(tiny: GenEval):
    images = [torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    prompts = ["a photo of a red apple", "a photo of two cats", "a photo of a cup left of a book"]
    fraction = tiny(images, prompts, inputs=[None, None, {"prompt": "x"}])
    assert all(0 <= s <= 1 for s in fraction)
    strict = GenEval(GenEvalOptions(preset="tiny", device="cpu", score="strict", threshold=0.52))
    assert set(strict(images, prompts)) <= {0.0, 1.0}
    with pytest.raises(PromptError):
        tiny(images[:1], ["a watercolour of the sea"])


def test_missing_detector_files(tmp_path: Path):
    (tmp_path / "owl").mkdir()
    with pytest.raises(UsageError) as err:
        GenEval(GenEvalOptions(detector_path=str(tmp_path / "owl"), device="cpu"))
    assert "GenEval detector (OWLv2): preprocessor_config.json" in err.value.message
    assert f"Put them in {tmp_path / 'owl'}" in err.value.render()
    assert (tiny_detector_directory() / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.long
def test_tiny_training_run_raises_the_reward(tmp_path: Path):
    check_reward_rises(tmp_path / "run", "geneval", 50, "--set", "rewards.0.options.preset=tiny",
                       "--set", "rewards.0.options.device=cpu", "--set", "rewards.0.options.threshold=0.53",
                       "--set", "rewards.0.options.counting_threshold=0.53", model="qwen-image", algo="flowgrpo")
