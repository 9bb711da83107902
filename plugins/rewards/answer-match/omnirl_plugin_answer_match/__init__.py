"""omnirl reward plugin: rule-based answer match for question-answer data."""
