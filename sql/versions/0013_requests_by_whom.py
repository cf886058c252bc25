"""Operator requests say who made them, and the peer may make only the
switchover steps; a split brain is recorded.

``operator_request.requested_by``: the session user that asked (``vpnrepl
audit`` lists the rows). ``vpnrepl_request(command, vpn, args)``: the one
way to ask, a ``SECURITY DEFINER`` function owned by the schema's owner (the
node's role): the owner may request any command; any other role that was
granted EXECUTE (the peer site's, README "In a deployment") only the
switchover steps it runs on this site, so INSERT on the table is granted
to no one else: the upgrade revokes what the previous release's README
granted (INSERT, and UPDATE/DELETE if any) from every role but the owner.
``vpn_state.split_brain``: this site learnt that both sites held the VPN
active at once (the same epoch on both, or a higher epoch elsewhere while
this site kept confirming past its take-over point); cleared when the site
becomes active or standby anew.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

from alembic import op

from sql._grants import revoke_from_others

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_UPGRADE = """
ALTER TABLE vpn_state ADD COLUMN split_brain boolean NOT NULL DEFAULT false;
ALTER TABLE operator_request ADD COLUMN requested_by text NOT NULL DEFAULT session_user;
CREATE FUNCTION vpnrepl_request(p_command text, p_vpn text, p_args jsonb) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE
    new_id bigint;
BEGIN
    IF session_user::text <> current_user::text
       AND p_command NOT IN ('switchover-prepare', 'switchover-finish', 'switchover-abort') THEN
        RAISE EXCEPTION 'role % may request only the switchover steps of a peer site, not %',
            session_user, p_command USING ERRCODE = 'insufficient_privilege';
    END IF;
    INSERT INTO operator_request (command, vpn, args, requested_by)
    VALUES (p_command, p_vpn, p_args, session_user) RETURNING id INTO new_id;
    RETURN new_id;
END
$$;
REVOKE ALL ON FUNCTION vpnrepl_request(text, text, jsonb) FROM PUBLIC;
-- the previous README granted the peer's role INSERT on the table: from now
-- on only the owner writes it (the function inserts as the owner)
"""


def upgrade() -> None:
    op.execute(_UPGRADE)
    op.execute(revoke_from_others("operator_request", ("INSERT", "UPDATE", "DELETE", "TRUNCATE")))


def downgrade() -> None:
    op.execute(
        "DROP FUNCTION vpnrepl_request(text, text, jsonb);"
        " ALTER TABLE operator_request DROP COLUMN requested_by;"
        " ALTER TABLE vpn_state DROP COLUMN split_brain"
    )
