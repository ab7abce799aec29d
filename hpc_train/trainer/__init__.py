"""The built-in trainer: one client of the public Run API, with its models and data."""
