"""A VPN's role changes: promotion, fencing, demotion, and promotion's
materialisation of live messages into the site's broker.
"""

from __future__ import annotations

from ._materialise import MaterialiseError, MaterialiseResult, materialise
from ._roles import (
    PromotionStart,
    RoleError,
    Tail,
    TailMessage,
    TakeoverUnknown,
    begin_promotion,
    demote_to_standby,
    ensure_fenced,
    fail_promotion,
    finish_promotion,
    read_tail,
    record_fenced,
)

__all__ = [
    "MaterialiseError",
    "MaterialiseResult",
    "PromotionStart",
    "RoleError",
    "Tail",
    "TailMessage",
    "TakeoverUnknown",
    "begin_promotion",
    "demote_to_standby",
    "ensure_fenced",
    "fail_promotion",
    "finish_promotion",
    "materialise",
    "read_tail",
    "record_fenced",
]
