"""omnirl reward plugin: how well Whisper's transcript of a generated speech matches the text it should say."""
