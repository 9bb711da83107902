"""The AR contract's sampling math, padding, prompt records and text samples (no model, no plugins)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from omnirl_core.ar.sampling import SamplingParams, pad_sequences, sample_tokens, sampling_logprobs
from omnirl_core.data.sources import load_records
from omnirl_core.errors import ConfigError
from omnirl_core.rundir.rundir import RunDir

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log() + 1.7  # any shift: softmax is invariant


def _kept(params: SamplingParams) -> list[int]:
    return torch.isfinite(sampling_logprobs(LOGITS, params)).nonzero()[:, 0].tolist()


def test_temperature_and_allowed_tokens():
    lp = sampling_logprobs(LOGITS, SamplingParams(temperature=0.5))
    torch.testing.assert_close(lp, torch.log_softmax(LOGITS / 0.5, -1))
    lp = sampling_logprobs(LOGITS, SamplingParams(allowed_token_ids=(1, 3)))
    assert math.isinf(lp[0]) and math.isinf(lp[2])
    torch.testing.assert_close(lp[[1, 3]].exp(), torch.tensor([0.3, 0.05]) / 0.35)


@pytest.mark.parametrize("top_p, kept", [(0.5, [0]), (0.7, [0, 1]), (0.81, [0, 1, 2]), (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float, kept: list[int]):
    assert _kept(SamplingParams(top_p=top_p)) == kept


def test_top_k_and_renormalisation():
    assert _kept(SamplingParams(top_k=3)) == [0, 1, 2]
    lp = sampling_logprobs(LOGITS, SamplingParams(top_k=2))
    torch.testing.assert_close(lp[:2].exp(), torch.tensor([0.5, 0.3]) / 0.8)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0.0)


def test_sampling_draws_the_distribution_row_by_row():
    lp = sampling_logprobs(LOGITS, SamplingParams(allowed_token_ids=(0, 1, 3))).expand(4000, -1)
    draws = sample_tokens(lp, [torch.Generator().manual_seed(i) for i in range(4000)])
    assert not (draws == 2).any()  # a masked token is never drawn
    freq = torch.bincount(draws, minlength=4).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.0, 0.05]) / 0.85, atol=0.03, rtol=0)
    # a row's draw depends on its own generator only
    alone = sample_tokens(lp[:1], [torch.Generator().manual_seed(7)])
    assert int(alone) == int(draws[7])


def test_padding_sides():
    ids, mask = pad_sequences([torch.tensor([5, 6, 7]), torch.tensor([8])], value=0, side="left")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    ids, mask = pad_sequences([torch.tensor([5, 6, 7]), torch.tensor([8])], value=0, side="right")
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_prompt_records(tmp_path: Path):
    assert load_records(["a", {"prompt": "b", "answer": 3}]) == [{"prompt": "a"}, {"prompt": "b", "answer": 3}]
    with pytest.raises(ConfigError, match="a record needs a non-empty text 'prompt' \\(no 'prompt' key\\)"):
        load_records([{"question": "b"}])
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "p", "audio": ["x.wav", "/abs/y.wav"], "answer": "x.wav"}) + "\n")
    [record] = load_records(str(data))
    assert record["audio"] == [str(tmp_path / "x.wav"), "/abs/y.wav"]
    assert record["answer"] == "x.wav"  # only media fields are paths


def test_text_outputs_are_saved_as_jsonl(tmp_path: Path):
    run = RunDir(tmp_path)
    run.samples.mkdir()
    path = run.save_grid(3, ["B", "CA"], ["q1", "q2"], columns=2, rewards=[1.0, 0.0])
    assert path.name == "step-000003.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"prompt": "q1", "output": "B", "reward": 1.0}, {"prompt": "q2", "output": "CA", "reward": 0.0}]
