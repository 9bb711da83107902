"""The omnirl command line (typer): parses, resolves through the core, and reports."""
