"""Errors that carry a message meant for the user: what went wrong and what to do."""


class TokentopError(Exception):
    """Base class: the message is shown to the user as is (no traceback)."""


class InvalidRequest(TokentopError):
    """A request was refused before it ran (bad prompt, bad sampling parameter)."""


class ModelError(TokentopError):
    """A model file could not be found, assembled, verified or loaded."""


class ConfigError(TokentopError):
    """A flag or engine setting is invalid."""


class WorkerDied(TokentopError):
    """The worker that owned a request stopped; the request failed with it."""


def describe_error(exc: BaseException) -> str:
    """One line for a user: a TokentopError is written for users as is; anything else also
    names its type, so an unexpected failure is still recognisable."""
    return str(exc) if isinstance(exc, TokentopError) else f"{type(exc).__name__}: {exc}"
