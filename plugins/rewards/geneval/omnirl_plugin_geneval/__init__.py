"""omnirl reward plugin: GenEval-style compositional reward on OWLv2 (no mmdet)."""
