"""``dare`` sub-commands (one module each; see ``dare.cli``)."""
