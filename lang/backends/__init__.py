"""DSL backends."""
