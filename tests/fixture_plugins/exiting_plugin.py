"""A broken plugin that ends the interpreter on import (seen in the wild: a CLI module imported as a plugin)."""

import sys

sys.exit(3)
