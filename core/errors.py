"""Exceptions that cross the engine boundary."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses as given; servers map it to gRPC INVALID_ARGUMENT."""
