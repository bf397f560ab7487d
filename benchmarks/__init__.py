"""Scripts that measure zerolap against its peers and print the ratios."""
