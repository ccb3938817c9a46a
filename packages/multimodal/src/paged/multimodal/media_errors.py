"""The error every media-loading failure raises (kept apart so fetch and policy can share it)."""


class MediaError(ValueError):
    """An image could not be loaded; the message says why (the API answers 400)."""
