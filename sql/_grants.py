"""SQL the migrations share: taking privileges on a table back from every
role but its owner (the node's role).

A table the peer's role must never read or write (the sync windows, the
marker key) or write (the operator requests) is revoked from ``PUBLIC``
and from each role that holds a privilege on it: a role given privileges
on new tables (``ALTER DEFAULT PRIVILEGES``) gets none here.
"""

from __future__ import annotations

__all__ = ["revoke_from_others"]

_PRIVILEGES = frozenset({"SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE"})


def revoke_from_others(table: str, privileges: tuple[str, ...] = ()) -> str:
    """A ``DO`` block revoking ``privileges`` (every one when empty) on
    ``table`` (a literal name of ours, never input) from every grantee but
    the current user."""
    if not table.isidentifier() or not set(privileges) <= _PRIVILEGES:
        raise ValueError(f"not a table of ours or not a privilege: {table!r} {privileges!r}")
    which = ", ".join(privileges) if privileges else "ALL"
    only = ""
    if privileges:
        listed = ", ".join(f"'{p}'" for p in privileges)
        only = f"\n               AND privilege_type IN ({listed})"
    return f"""DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT DISTINCT grantee FROM information_schema.role_table_grants
             WHERE table_schema = current_schema() AND table_name = '{table}'{only}
               AND grantee <> current_user
    LOOP
        EXECUTE 'REVOKE {which} ON {table} FROM '
            || CASE WHEN r.grantee = 'PUBLIC' THEN 'PUBLIC' ELSE quote_ident(r.grantee) END;
    END LOOP;
END
$$;
"""  # noqa: S608 - the names are checked above: literals of the migrations
