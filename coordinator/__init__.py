"""The coordinator: rounds, aggregation, durable state, the HTTP API and the MQTT connection."""
