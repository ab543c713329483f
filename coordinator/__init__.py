"""The coordinator: power-limit optimisation and job bookkeeping over NATS."""
