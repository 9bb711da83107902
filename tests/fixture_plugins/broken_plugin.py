"""A plugin that fails at import (for the discovery tests)."""

raise RuntimeError("this plugin is broken on purpose")
