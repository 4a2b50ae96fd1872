"""Errors a user caused. Each message says what to change.

The HTTP layer maps these onto OpenAI-style error bodies; the CLI prints them.
"""


class ShapeserveError(Exception):
    """Base class for errors the user can fix (bad input, bad config)."""

    #: HTTP status the router answers with when this error reaches the edge.
    http_status = 400
    #: OpenAI error ``type`` field.
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        #: OpenAI error ``code`` (e.g. "context_length_exceeded"), when there is a standard one.
        self.code = code


class InvalidRequestError(ShapeserveError):
    """A request (sampling parameters, prompt) that can never be served as given."""


class ModelLoadError(ShapeserveError):
    """A model directory that is missing, incomplete, or of an unsupported architecture."""

    http_status = 404
    error_type = "not_found_error"


class ConfigError(ShapeserveError):
    """A configuration file or flag with a bad value."""
