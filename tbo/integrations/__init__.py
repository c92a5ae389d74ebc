"""Adapters that run other people's model implementations through tbo (imported lazily, per framework)."""
