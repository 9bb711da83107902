"""The host process: the thread policy (and its governor), once-per-process library warnings, and the
patch an engine environment applies to a library after install."""
