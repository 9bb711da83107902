"""Prompt data: sources, the train / test split, and the prompt sets shipped with omnirl (``builtin/``)."""
