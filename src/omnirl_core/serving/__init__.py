"""Engines in processes and environments of their own: the rollout server and its client, and the
engine environments (``omnirl env build``)."""
