"""Scenarios and tools built on the runtime's public API (drill, server); nothing in the runtime imports them."""
