"""Sizes and memory: parameter counts against published totals (``sizing``) and memory budgets
(``memory``)."""
