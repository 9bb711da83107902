"""omnirl reward plugin: rule-based answer match for question-answer data."""

from omnirl_core import hookimpl
from omnirl_core.registry import RewardSpec


@hookimpl
def omnirl_register_rewards(register):
    register(
        RewardSpec(
            name="answer-match",
            aliases=("answer", "exact-match"),
            description="1 when the answer extracted from the text (choice letter, number, \\boxed{}, or the whole "
            "text) equals the prompt record's reference answer, else 0.",
            factory="omnirl_plugin_answer_match.reward:AnswerMatch",
            config="omnirl_plugin_answer_match.reward:AnswerMatchOptions",
            modality="text",
            default_prompts="omnirl_plugin_answer_match.tasks:CHOICE_QUESTIONS",
            input_fields="omnirl_plugin_answer_match.reward:input_fields",
        )
    )
