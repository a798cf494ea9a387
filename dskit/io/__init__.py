"""Small I/O helpers every family shares: atomic output, bounded reads, stdout, escaped text."""
