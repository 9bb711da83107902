"""Flow-matching models: the SDE/ODE sampler and its log-probs (``sampler``), the diffusers model base and
the model-author kit (``model``), the flow policy-gradient base of the flow algorithms (``policy_gradient``),
and the prompt-embedding cache (``embedding_cache``)."""
