"""Admission integrations: a gateway middleware (ASGI) and a simulated-time gateway."""
