"""Replication between sites: ledger, bridge protocol, standby apply, sync,
fencing, promotion and full-sync reconciliation.

The public API is listed in ``__all__`` as each capability lands.
"""

__all__: list[str] = []
