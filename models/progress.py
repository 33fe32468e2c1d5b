"""Progress bars drawn on a terminal only: a redirected command or a daemon's log file never fills with `\\r` bars."""
from __future__ import annotations


def bar_disable(wanted: bool) -> bool | None:
    """tqdm's `disable`: True when no bar is wanted, else None, which tqdm reads as "only when the stream is a
    terminal"."""
    return True if not wanted else None
