"""precast serve: an OpenAI-compatible HTTP server with Prometheus metrics."""
