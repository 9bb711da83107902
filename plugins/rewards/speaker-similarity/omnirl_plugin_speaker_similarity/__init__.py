"""omnirl reward plugin: how much generated speech sounds like a reference voice (speaker-embedding cosine)."""
