"""Errors the library raises on purpose (callers map these to clear messages / HTTP 4xx)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, unexpected or mis-shaped tensors, a corrupt file."""


class TrainingError(RuntimeError):
    """A run that cannot go on (a checkpoint of another base model, no usable data): one line."""


class RequestError(ValueError):
    """A request the engine cannot answer as asked (HTTP 400 api_usage_error)."""

    error_type = "api_usage_error"


class TokenLimitError(RequestError):
    """A request over the token budget, detected before any work (HTTP 413)."""


class ImageError(RequestError):
    """An image asset that cannot be read: corrupt, truncated, not an image, an unsupported format
    (HTTP 400 naming the asset)."""


class ImageTooLargeError(ImageError):
    """An image over the byte or pixel limits, detected before it is decoded (HTTP 413)."""


class ReservedTextError(RequestError):
    """Request text holding a token the model reserves for reading (Mode B's option marker): it
    would be read as structure, so it is refused (HTTP 422, located at the offending field)."""

    def __init__(self, message: str, loc: tuple = ()):
        super().__init__(message)
        self.loc = loc
