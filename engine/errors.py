"""Errors that carry a message meant for the user: what went wrong and what to do.

The engine is a library, so its messages (errors and log lines) name a setting by its config
field (EngineConfig, WorkerConfig, ServeConfig), in backticks, so that a front end can show it
its own way: `max_context` alone, or `kv_cache_memory=256MiB` with a value (everything up to
the closing backtick). Nothing else in a message is backticked. The command line shows them as
flags, --max-context and --kv-cache-memory 256MiB (app/flags.py). A request's own fields
(max_tokens, temperature) are the caller's names and stay plain.
"""


class TokentopError(Exception):
    """Base class: the message is shown to the user as is (no traceback)."""


class InvalidRequest(TokentopError):
    """A request was refused before it ran (bad prompt, bad sampling parameter)."""


class ModelError(TokentopError):
    """A model file could not be found, assembled, verified or loaded."""


class ConfigError(TokentopError):
    """An engine setting is invalid."""


class WorkerDied(TokentopError):
    """The worker that owned a request stopped; the request failed with it."""


def describe_error(exc: BaseException) -> str:
    """One line for a user: a TokentopError is written for users as is; anything else also
    names its type, so an unexpected failure is still recognisable."""
    return str(exc) if isinstance(exc, TokentopError) else f"{type(exc).__name__}: {exc}"
