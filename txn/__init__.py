"""The internal two-phase (XA) coordinator and participant, with recovery.

The public API is listed in ``__all__`` as each capability lands.
"""

__all__: list[str] = []
