"""The merge engine. It knows nothing of Textual or questionary; front ends consume its events.

Heavy libraries (torch) are imported inside functions so that importing this package stays cheap.
"""

from tui_merger.core.errors import MergeCancelled, MergeError
from tui_merger.core.events import (
    CancelToken,
    Event,
    MergeFinished,
    Notice,
    PhaseStarted,
    TensorProgress,
)
from tui_merger.core.options import MergeOptions, MergeResult

__all__ = [
    "CancelToken",
    "Event",
    "MergeCancelled",
    "MergeError",
    "MergeFinished",
    "MergeOptions",
    "MergeResult",
    "Notice",
    "PhaseStarted",
    "TensorProgress",
]
