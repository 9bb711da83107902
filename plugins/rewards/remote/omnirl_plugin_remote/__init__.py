"""omnirl reward plugin: remote (a reward served by `omnirl reward serve NAME`)."""
