"""Small helpers with no torch and no tbo imports, usable from every layer but the core (which stays self-contained)."""
