"""tokentop's inference engine: a library with no knowledge of the UI (it never imports `app`).

Imports sit at the top of each module. The one exception is torch, and the modules that
import it, in code the dashboard's process runs (the facade and what it calls at submit and
start-up): there they are imported inside the function that needs them, so the dashboard
starts without loading torch, which only its worker processes need.
"""
