"""`tokentop watch`: engines this process does not own, read over HTTP (sources.py: one scrape
of one server; watcher.py: history, percentiles and alerts over time)."""
