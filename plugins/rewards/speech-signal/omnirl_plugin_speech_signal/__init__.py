"""omnirl reward plugin: signal checks on generated speech (clipping, silence, duration against the text)."""
