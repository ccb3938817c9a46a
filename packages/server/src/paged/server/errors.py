"""Errors the frontend raises for bad input, carrying the offending parameter."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request that cannot be served as asked; `param` names the field at fault.

    A `ValueError`, so library users can catch it as such; the API server
    maps it to HTTP 400 with an OpenAI-style body naming `param`.
    """

    def __init__(self, param: str | None, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.message = message
        self.code = code


class ContextLengthError(InvalidRequestError):
    """The prompt, or the prompt plus max_tokens, does not fit in max_model_len."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(param, message, code="context_length_exceeded")


def from_value_error(e: ValueError) -> InvalidRequestError:
    """Wrap a plain `ValueError` whose message starts with the field name.

    `SamplingParams.validate()` words every error as "<field> must ...".
    """
    if isinstance(e, InvalidRequestError):
        return e
    message = str(e)
    field = message.split(" ", 1)[0]
    param = field if field.isidentifier() else None
    return InvalidRequestError(param, message)
