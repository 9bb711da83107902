"""RL math independent of the model family: group advantages (``advantage``), rollout correction
(``correction``) and exponential moving averages (``ema``)."""
