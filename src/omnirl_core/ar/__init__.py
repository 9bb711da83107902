"""Autoregressive (token) models: the token distribution and its log-probs (``sampling``), the causal-LM base
of AR model plugins (``model``) and the token policy-gradient base of GSPO/GRPO (``policy_gradient``)."""
