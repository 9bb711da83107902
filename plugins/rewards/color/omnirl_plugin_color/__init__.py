"""omnirl reward plugin: colour match between an image and the colour its prompt names."""
