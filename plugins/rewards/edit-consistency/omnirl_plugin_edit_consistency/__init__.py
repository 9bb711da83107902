"""omnirl reward plugin: editing rewards that read the edit's source (``edit-consistency``, ``edit-color``)."""
