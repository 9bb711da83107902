"""omnirl model plugin: BAGEL (BAGEL-7B-MoT), a native implementation. Importing this module is cheap: no torch."""
