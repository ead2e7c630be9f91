"""Integrations with model libraries (each an optional dependency): `transformers`."""
