"""Small local models and data for tests and demos (no downloads)."""
