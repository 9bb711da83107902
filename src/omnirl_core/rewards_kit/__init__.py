"""Code the learned-reward plugins share (plugins never import each other): CLIP loading and preprocessing
(``clip``), tiny random-weight CLIP presets (``tiny_clip``), and the offline-aware ``from_pretrained`` with
errors that name the missing files. Importing this package loads nothing heavy; its modules import torch."""
