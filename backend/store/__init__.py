"""The database: engine, the run/node tables and the telemetry tables."""
