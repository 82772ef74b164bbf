"""`tokentop serve`: an OpenAI-compatible HTTP API and Prometheus metrics over the Engine."""
