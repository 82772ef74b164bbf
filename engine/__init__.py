"""tokentop's inference engine. Never imports `app`."""
