"""Planning: what each rank holds or wants -> who writes what, and which bytes to read."""
