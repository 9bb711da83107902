"""Config layering, --set parsing, unknown keys with did-you-mean, secrets redacted."""

import pytest
from pydantic import BaseModel, ConfigDict, SecretStr

from omnirl_core.config import build_config, deep_merge, parse_set, validate_options
from omnirl_core.errors import ConfigError


def test_set_parses_yaml_scalars_and_nested_paths():
    out = parse_set(["train.lr=3e-4", "run.steps=7", "model.lora.enabled=false", "rewards.0.name=jpeg",
                     "model.lora.target_modules=[to_q,to_k]"])
    assert out["train"]["lr"] == 3e-4 and out["run"]["steps"] == 7
    assert out["model"]["lora"]["enabled"] is False
    assert out["rewards"] == {0: {"name": "jpeg"}}  # a list patch: deep_merge applies it to the list beneath
    assert deep_merge({}, out)["rewards"] == [{"name": "jpeg"}]
    assert out["model"]["lora"]["target_modules"] == ["to_q", "to_k"]
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_set(["train.lr"])


def test_unknown_keys_and_bad_values_are_reported_together_with_paths():
    with pytest.raises(ConfigError) as err:
        build_config({"trian": {"lr": 1}, "run": {"steps": -3, "sead": 1}, "rollout": {"group_size": 0}})
    text = err.value.render()
    assert "trian: unknown key. Did you mean 'train'?" in text
    assert "run.sead: unknown key. Did you mean 'seed'?" in text
    assert "run.steps" in text and "greater than or equal to 1" in text
    assert "rollout.group_size" in text
    assert "3 problem" in text or "4 problem" in text


def test_layers_merge_dicts_and_replace_lists():
    base = {"rollout": {"height": 512, "width": 512}, "rewards": [{"name": "jpeg"}]}
    merged = deep_merge(base, {"rollout": {"height": 32}, "rewards": [{"name": "color"}]})
    assert merged == {"rollout": {"height": 32, "width": 512}, "rewards": [{"name": "color"}]}
    assert base["rollout"]["height"] == 512


def test_set_patches_one_item_of_a_list_and_keeps_the_rest():
    # the CONTRIBUTING example: an option of the first reward, the reward list coming from a lower layer
    base = {"rewards": [{"name": "jpeg", "weight": 2.0}, {"name": "color"}]}
    merged = deep_merge(base, parse_set(["rewards.0.options.scale=2", "rewards.1.weight=0.5"]))
    assert merged["rewards"] == [{"name": "jpeg", "weight": 2.0, "options": {"scale": 2}},
                                 {"name": "color", "weight": 0.5}]
    assert deep_merge(base, parse_set(["rewards.2.name=ocr"]))["rewards"][2] == {"name": "ocr"}  # append
    with pytest.raises(ConfigError, match=r"rewards.5: index out of range \(rewards has 2 item"):
        deep_merge(base, parse_set(["rewards.5.name=ocr"]))
    with pytest.raises(ConfigError, match="leave gaps"):
        deep_merge({}, parse_set(["rewards.1.name=ocr"]))


def test_validation_errors_never_echo_a_secret_value():
    class Opts(BaseModel):
        model_config = ConfigDict(extra="forbid")
        api_key_env: str = "OMNIRL_JUDGE_API_KEY"

    with pytest.raises(ConfigError) as err:
        validate_options({"api_key_env": ["sk-live-123456"]}, Opts, "rewards.0.options")
    assert "sk-live-123456" not in err.value.render() and "<redacted>" in err.value.render()


class _Opts(BaseModel):
    model_config = ConfigDict(extra="forbid")
    api_key: SecretStr = SecretStr("")
    temperature: float = 1.0


def test_plugin_options_validate_with_did_you_mean_and_redact_secrets():
    with pytest.raises(ConfigError) as err:
        validate_options({"temprature": 0.5}, _Opts, "rewards.0.options")
    assert "rewards.0.options.temprature: unknown key. Did you mean 'temperature'?" in err.value.render()
    opts = validate_options({"api_key": "sk-secret"}, _Opts, "rewards.0.options")
    dumped = opts.model_dump(mode="json")
    assert "sk-secret" not in str(dumped) and dumped["api_key"] == "**********"
    with pytest.raises(ConfigError, match="takes no options"):
        validate_options({"x": 1}, None, "train.options")


def test_suggested_rollout_options_follow_the_chosen_engine():
    """The model's suggested options were written for its suggested engine (transformers): under another engine
    the options it lacks are left out, the shared sampling ones kept; the user's own options are still checked."""
    from omnirl_core.plugins import get_plugin_manager
    from omnirl_core.resolve import resolve_run

    manager = get_plugin_manager()
    if "vllm" not in {s.name for s in manager.registries["engine"]}:
        pytest.skip("the vllm engine plugin is not installed")
    base = {"model": {"name": "qwen3-omni"}, "algorithm": {"name": "gspo"}, "run": {"device": "cpu"}}
    plain = resolve_run(manager, [base], probe_device=False)
    assert plain.options["rollout.options"].max_batch_size == 32  # the suggestion, on its own engine
    other = resolve_run(manager, [deep_merge(base, {"rollout": {"engine": "vllm"}})], probe_device=False)
    assert other.options["rollout.options"].max_new_tokens == 1024  # shared: kept
    assert "max_batch_size" not in type(other.options["rollout.options"]).model_fields
    tiny = resolve_run(manager, [deep_merge(base, {"model": {"preset": "tiny"}, "rollout": {"engine": "vllm"}})],
                       probe_device=False)
    assert tiny.options["rollout.options"].allowed_tokens == ["A", "B", "C", "D"]
    with pytest.raises(ConfigError) as err:
        resolve_run(manager, [deep_merge(base, {"rollout": {"engine": "vllm", "options": {"max_batch_size": 4}}})],
                    probe_device=False)
    assert "rollout.options.max_batch_size: unknown key" in err.value.render()
