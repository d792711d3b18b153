"""Errors meant for people: each carries one sentence saying what is wrong and what to do."""


class MergeError(Exception):
    """An expected failure (bad input, full disk, ...). ``str(err)`` is shown to the user as is."""


class MergeCancelled(MergeError):
    """The user asked to stop; the partial output has been removed."""

    def __init__(self, message: str = "Merge cancelled; nothing was written.") -> None:
        super().__init__(message)
