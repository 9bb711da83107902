"""Rewards at run time: dispatch (weighted sums, deadlines, health), the one reward server and its wire
format."""
