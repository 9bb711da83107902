"""omnirl reward plugin: OCR accuracy of the text a prompt asks for (RapidOCR, offline models)."""

from omnirl_core import hookimpl
from omnirl_core.registry import RewardSpec


@hookimpl
def omnirl_register_rewards(register):
    register(
        RewardSpec(
            name="ocr",
            description="1 - normalised edit distance between the text read by RapidOCR and the quoted text "
            "of the prompt.",
            factory="omnirl_plugin_ocr.reward:OCRReward",
            config="omnirl_plugin_ocr.reward:OCROptions",
            modality="image",
            batched=False,
            resources={"CPU": 1.0},
            default_prompts="omnirl_plugin_ocr.reward:DEFAULT_PROMPTS",
        )
    )
