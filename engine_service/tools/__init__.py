"""Command-line tools: prepare the default model, launch servers as subprocesses, the
one-machine stack."""
