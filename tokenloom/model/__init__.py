"""Everything that touches torch lives here and nowhere above it."""
