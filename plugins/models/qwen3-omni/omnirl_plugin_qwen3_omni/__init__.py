"""omnirl model plugin: the Qwen3-Omni thinker (transformers). Importing this module is cheap: no torch."""

from omnirl_core import hookimpl
from omnirl_core.registry import ModelSpec


@hookimpl
def omnirl_register_models(register):
    register(
        ModelSpec(
            name="qwen3-omni",
            aliases=("qwen3-omni-thinker", "qwen3_omni"),
            description="Qwen3-Omni thinker (MoE decoder; image and audio encoders) as an autoregressive text "
            "policy via transformers.",
            factory="omnirl_plugin_qwen3_omni.model:create_model",
            config="omnirl_plugin_qwen3_omni.model:Qwen3OmniOptions",
            capabilities=frozenset({"ar-text", "text", "lora", "image-input", "audio-input"}),
            presets=("tiny",),
            default_path="Qwen/Qwen3-Omni-30B-A3B-Instruct",
            sizing="omnirl_plugin_qwen3_omni.sizing:sizing",
            recipe_defaults={
                "model": {"dtype": "bfloat16", "lora": {"rank": 32, "alpha": 64}},
                "rollout": {"engine": "transformers", "prompts_per_step": 8, "group_size": 16,
                            "options": {"max_new_tokens": 1024, "max_batch_size": 32}},
                "train": {"lr": 3e-6, "micro_batch_size": 4},
                "rewards": [{"name": "answer-match"}],
            },
            preset_defaults={
                # a random-weight model over a 152k vocabulary would never write an answer letter: the tiny
                # preset samples only the letters and the stop token (guided choice), so that the rule reward
                # has signal and learning is visible in a minute
                "tiny": {
                    "model": {"dtype": "float32", "lora": {"rank": 16, "alpha": 32}},
                    "rollout": {"prompts_per_step": 4, "group_size": 8,
                                "options": {"max_new_tokens": 2, "allowed_tokens": ["A", "B", "C", "D"]}},
                    "train": {"lr": 1e-3, "minibatches": 2, "micro_batch_size": 16},
                    "run": {"steps": 40, "save_every": 20, "sample_every": 10},
                },
            },
        )
    )
