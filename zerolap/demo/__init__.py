"""The demo training run (``zerolap demo``): a small GPT learns zerolap's own documentation."""
