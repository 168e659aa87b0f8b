"""verl glue: config schema, engine/worker registration, metrics."""
