"""Remote workers: an OpenAI-compatible server behind the router, driven from the facade's process."""
