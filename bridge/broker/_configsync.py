"""Config-sync: what the bridge reads from and writes to a RabbitMQ management API.

The active lists every replicated VPN as one JSON document
(:func:`vpn_definitions`, shaped by :func:`shape_vpn_definitions`: the
vhost's definitions export plus the users holding a permission on it, with
their permissions there). The standby imports it at every listing
(:func:`import_vpn_definitions`) and keeps the newest copy, which
:func:`reimport` imports again at a promotion, with the topology changes
streamed since (:mod:`bridge._definitions`). Config-sync adds and updates;
it deletes only what a client deleted through the listener
(:func:`carry_out_deletions`). What travels, which users it may touch
(:data:`SYNCED_TAG`, ``copy_tags``, ``keep_users``) and why:
docs/behaviour.md, "Config-sync".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol
from urllib.parse import quote

import psycopg

from bridge._definitions import DefinitionsError, streamed_deletions
from bridge._errors import BridgeError
from bridge._events import TopologyChanged
from bridge.store import stored_topology

from ._management import ManagementAPI, ManagementUnavailable

__all__ = [
    "SYNCED_TAG",
    "ConfigSyncError",
    "carry_out_deletions",
    "import_vpn_definitions",
    "reimport",
    "shape_vpn_definitions",
    "split_vpn_definitions",
    "vpn_definitions",
]

log = logging.getLogger(__name__)

#: the tag of a user config-sync created on this site's broker (it grants
#: nothing in RabbitMQ): only such users are config-sync's to update
SYNCED_TAG = "vpnrepl-config-sync"

#: the keys of the document that are not the vhost's own definitions
ACCESS_KEYS = ("users", "permissions", "topic_permissions")
_USER_FIELDS = ("name", "password_hash", "hashing_algorithm")
_PERMISSION_FIELDS = ("configure", "write", "read")
_TOPIC_FIELDS = ("exchange", "write", "read")


class ConfigSyncError(BridgeError):
    """A VPN's definitions could not be read, or not imported into the local
    broker (the management API failed, the document is malformed, or the
    stored copy could not be read); config-sync tries again at the next
    listing."""


class _Reads(Protocol):
    def get(self, path: str) -> object: ...


# ---------------------------------------------------------------- the document


def shape_vpn_definitions(
    vhost: str,
    export: Mapping[str, Any],
    permissions: Sequence[Mapping[str, Any]],
    topic_permissions: Sequence[Mapping[str, Any]],
    users: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """The document for ``vhost``: its definitions ``export`` plus the
    ``users`` (by name, as ``GET /api/users/{name}`` has them) holding one of
    ``permissions`` on the vhost, those permissions, and their
    ``topic_permissions`` on it. Permissions may be given for every vhost;
    a permission holder missing from ``users`` (deleted meanwhile) is left
    out with its permissions. Sorted, so the same state gives the same bytes."""
    mine = [p for p in permissions if p.get("vhost") == vhost and p.get("user") in users]
    holders = {str(p["user"]) for p in mine}
    topics = [t for t in topic_permissions if t.get("vhost") == vhost and t.get("user") in holders]
    doc = {k: v for k, v in export.items() if k not in ACCESS_KEYS}
    doc["users"] = [_user_entry(users[name]) for name in sorted(holders)]
    doc["permissions"] = sorted(
        (_pick(p, ("user", "vhost", *_PERMISSION_FIELDS)) for p in mine),
        key=lambda p: str(p["user"]),
    )
    doc["topic_permissions"] = sorted(
        (_pick(t, ("user", "vhost", *_TOPIC_FIELDS)) for t in topics),
        key=lambda t: (str(t["user"]), str(t["exchange"])),
    )
    return doc


def split_vpn_definitions(
    vhost: str, definitions_json: bytes
) -> tuple[bytes, dict[str, list[dict[str, Any]]]]:
    """The vhost part of a document (what ``POST /api/definitions/{vhost}``
    takes) and its access part: ``users``, and the ``permissions`` and
    ``topic_permissions`` on ``vhost`` of those users (anything else is
    dropped). A document without users (from an older active) has an empty
    access part."""
    try:
        doc = json.loads(definitions_json)
    except ValueError as e:
        raise ConfigSyncError(f"the definitions of {vhost} are not JSON: {e}") from e
    if not isinstance(doc, dict):
        raise ConfigSyncError(f"the definitions of {vhost} are not a JSON object")
    users = [_user_entry(u) for u in _records(doc.get("users", []), "users")]
    names = {u["name"] for u in users}
    access = {
        "users": users,
        "permissions": [
            _pick(p, ("user", *_PERMISSION_FIELDS))
            for p in _records(doc.get("permissions", []), "permissions")
            if p.get("vhost", vhost) == vhost and p.get("user") in names
        ],
        "topic_permissions": [
            _pick(t, ("user", *_TOPIC_FIELDS))
            for t in _records(doc.get("topic_permissions", []), "topic_permissions")
            if t.get("vhost", vhost) == vhost and t.get("user") in names
        ],
    }
    vhost_part = {k: v for k, v in doc.items() if k not in ACCESS_KEYS}
    return json.dumps(vhost_part).encode(), access


def _user_entry(user: Mapping[str, Any]) -> dict[str, Any]:
    """A user as the global definitions export has it (tags as a list)."""
    if not isinstance(user.get("name"), str) or not user["name"]:
        raise ConfigSyncError("a user without a name in the definitions")
    entry = _pick(user, _USER_FIELDS)
    entry["tags"] = _tags(user.get("tags", []))
    if isinstance(user.get("limits"), Mapping):
        entry["limits"] = dict(user["limits"])
    return entry


def _tags(value: object) -> list[str]:
    """RabbitMQ gives tags as a list (3.9+) or a comma-separated string."""
    if isinstance(value, str):
        return sorted(t.strip() for t in value.split(",") if t.strip())
    if isinstance(value, list):
        return sorted(str(t) for t in value)
    return []


def _pick(record: Mapping[str, Any], fields: Iterable[str]) -> dict[str, Any]:
    return {f: record[f] for f in fields if f in record}


def _records(found: object, what: str) -> list[dict[str, Any]]:
    if not isinstance(found, list) or not all(isinstance(r, dict) for r in found):
        raise ConfigSyncError(f"unexpected {what}: not a list of objects")
    return found


def _get_or_none(api: _Reads, path: str) -> dict[str, Any] | None:
    """``GET path``, or None when the broker answers 404."""
    try:
        found = api.get(path)
    except ManagementUnavailable as e:
        if e.not_found:
            return None
        raise
    if not isinstance(found, dict):
        raise ConfigSyncError(f"unexpected answer to GET /api/{path}: not an object")
    return found


# ---------------------------------------------------------------- the active


def vpn_definitions(api: _Reads, vpn: str) -> bytes:
    """The document the active lists ``vpn`` with (see the module docstring)."""
    name = quote(vpn, safe="")
    try:
        export = api.get(f"definitions/{name}")
        if not isinstance(export, dict):
            raise ConfigSyncError(f"unexpected definitions of {vpn}: not a JSON object")
        permissions = _records(api.get(f"vhosts/{name}/permissions"), "permissions")
        topics = _records(api.get(f"vhosts/{name}/topic-permissions"), "topic permissions")
        users: dict[str, dict[str, Any]] = {}
        for holder in sorted({str(p.get("user")) for p in permissions if p.get("vhost") == vpn}):
            found = _get_or_none(api, f"users/{quote(holder, safe='')}")
            if found is not None:  # a user deleted meanwhile goes with its permissions
                users[holder] = found
    except ManagementUnavailable as e:
        raise ConfigSyncError(str(e)) from e
    doc = shape_vpn_definitions(vpn, export, permissions, topics, users)
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


# ---------------------------------------------------------------- the standby


def import_vpn_definitions(api: ManagementAPI, vpn: str, definitions_json: bytes) -> bool:
    """Bring the local broker in line with the active's document for ``vpn``:
    create the vhost if needed, import its definitions, then the users with
    their password hashes, tags and limits, and their (topic) permissions on
    the vhost. The active's version wins over what the standby has, except
    for ``api.keep_users`` (this node's own users), which are never touched.
    Nothing is deleted. Returns True when the vhost was created."""
    vhost_part, access = split_vpn_definitions(vpn, definitions_json)
    try:
        created = api.import_definitions(vpn, vhost_part)
        _import_access(api, vpn, access)
    except ManagementUnavailable as e:
        raise ConfigSyncError(str(e)) from e
    return created


def _import_access(api: ManagementAPI, vpn: str, access: dict[str, list[dict[str, Any]]]) -> None:
    kept = sorted({u["name"] for u in access["users"]} & api.keep_users)
    if kept and vpn not in api.kept_noted:
        api.kept_noted.add(vpn)
        log.info(
            "config-sync: VPN %s: user(s) %s left as they are here (this site's node logs "
            "in with them); the active's password and permissions are not taken",
            vpn,
            ", ".join(kept),
        )
    for user in access["users"]:
        if user["name"] not in api.keep_users:
            _import_user(api, vpn, user)
    name = quote(vpn, safe="")
    here = {
        p.get("user"): _pick(p, _PERMISSION_FIELDS)
        for p in _records(api.get(f"vhosts/{name}/permissions"), "permissions")
    }
    for p in access["permissions"]:
        user, want = p["user"], _pick(p, _PERMISSION_FIELDS)
        if user not in api.keep_users and here.get(user) != want:
            api.put(f"permissions/{name}/{quote(user, safe='')}", json.dumps(want).encode())
    topics_here = {
        (t.get("user"), t.get("exchange")): _pick(t, _TOPIC_FIELDS)
        for t in _records(api.get(f"vhosts/{name}/topic-permissions"), "topic permissions")
    }
    for t in access["topic_permissions"]:
        user, want = t["user"], _pick(t, _TOPIC_FIELDS)
        if user not in api.keep_users and topics_here.get((user, t.get("exchange"))) != want:
            api.put(f"topic-permissions/{name}/{quote(user, safe='')}", json.dumps(want).encode())


def _import_user(api: ManagementAPI, vpn: str, user: dict[str, Any]) -> None:
    """Create one user, or update one config-sync created; its limits follow
    when the active sent them. A user this site made itself is left alone."""
    path = f"users/{quote(user['name'], safe='')}"
    here = _get_or_none(api, path)
    if (
        here is not None
        and SYNCED_TAG not in _tags(here.get("tags"))
        and here.get("password_hash") == user.get("password_hash")
    ):
        # the same salted hash: a copy an earlier release's config-sync made
        # (before the mark), config-sync's from now on, its tags made ours
        log.info(
            "config-sync: VPN %s: user %s, copied here by an earlier release, is "
            "config-sync's from now on",
            vpn,
            user["name"],
        )
    elif here is not None and SYNCED_TAG not in _tags(here.get("tags")):
        if user["name"] not in api.not_ours:
            api.not_ours.add(user["name"])
            log.warning(
                "config-sync: VPN %s: user %s exists on this site and config-sync did not "
                "create it: left as it is (its password and tags are this site's)",
                vpn,
                user["name"],
            )
        return
    want = _pick(user, _USER_FIELDS[1:])  # (an older active may not name the algorithm)
    tags = sorted({t for t in user["tags"] if t in api.copy_tags} | {SYNCED_TAG})
    same = (
        here is not None
        and {k: here.get(k) for k in want} == want
        and _tags(here.get("tags")) == tags
    )
    if not same:
        body = {**want, "tags": ",".join(tags)}
        api.put(path, json.dumps(body).encode())
        done = "created" if here is None else "updated (password, algorithm or tags)"
        log.info("config-sync: VPN %s: user %s %s from the active", vpn, user["name"], done)
        here = _get_or_none(api, path)
    if "limits" not in user or here is None:
        return
    want_limits: dict[str, Any] = user["limits"]
    have_limits = here.get("limits") or {}
    limits = f"user-limits/{quote(user['name'], safe='')}"
    for key, value in want_limits.items():
        if have_limits.get(key) != value:
            api.put(f"{limits}/{quote(key, safe='')}", json.dumps({"value": value}).encode())
    for key in have_limits.keys() - want_limits.keys():
        api.delete(f"{limits}/{quote(key, safe='')}")


def carry_out_deletions(
    api: ManagementAPI, vpn: str, changes: Sequence[TopologyChanged], definitions_json: bytes
) -> int:
    """Delete from the local broker what ``changes`` (streamed topology
    changes) deleted and ``definitions_json`` does not hold again: queues,
    exchanges, and bindings (found by their ends, routing key and
    arguments, as the broker keys them). What is gone already is skipped.
    Returns how many objects were deleted."""
    try:
        doc = json.loads(definitions_json) if definitions_json else {}
        todo = streamed_deletions(changes, doc)
    except (ValueError, DefinitionsError) as e:
        raise ConfigSyncError(f"the definitions of {vpn} are unusable: {e}") from e
    name = quote(vpn, safe="")
    done = 0
    try:
        for op, item in todo:
            if op == "queue.delete":
                done += _delete(api, f"queues/{name}/{quote(item['name'], safe='')}")
            elif op == "exchange.delete":
                done += _delete(api, f"exchanges/{name}/{quote(item['name'], safe='')}")
            else:
                done += _unbind(api, name, item)
    except ManagementUnavailable as e:
        raise ConfigSyncError(str(e)) from e
    return done


def _delete(api: ManagementAPI, path: str) -> int:
    try:
        api.delete(path)
    except ManagementUnavailable as e:
        if e.not_found:
            return 0
        raise
    return 1


def _unbind(api: ManagementAPI, vhost: str, item: Mapping[str, Any]) -> int:
    kind = "q" if item["destination_type"] == "queue" else "e"
    ends = f"e/{quote(item['source'], safe='')}/{kind}/{quote(item['destination'], safe='')}"
    found = _get_or_none_list(api, f"bindings/{vhost}/{ends}")
    want = (item.get("routing_key", ""), item.get("arguments") or {})
    done = 0
    for b in found:
        if (b.get("routing_key", ""), b.get("arguments") or {}) == want:
            key = quote(str(b.get("properties_key", "")), safe="")
            done += _delete(api, f"bindings/{vhost}/{ends}/{key}")
    return done


def _get_or_none_list(api: ManagementAPI, path: str) -> list[dict[str, Any]]:
    try:
        return _records(api.get(path), "bindings")
    except ManagementUnavailable as e:
        if e.not_found:
            return []
        raise


def reimport(api: ManagementAPI, vpn: str, dsn: str) -> bool:
    """Import the definitions this site holds for ``vpn`` (the active's last
    listing with the topology changes streamed since, see
    :class:`~bridge.store._topology.StoredTopology`) into the local broker,
    users and permissions included, as :func:`import_vpn_definitions` does,
    and carry out the streamed deletes; for a promotion, which must not
    depend on the active being reachable (blocking; run in a thread). False
    when this site holds no definitions at all."""
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            stored = stored_topology(vpn).run(conn)
    except psycopg.Error as e:
        text = e.diag.message_primary or (str(e).strip().splitlines() or [""])[0]
        raise ConfigSyncError(f"the stored definitions cannot be read: database: {text}") from e
    try:
        definitions = stored.merged()
    except DefinitionsError as e:
        raise ConfigSyncError(str(e)) from e
    if definitions is None:
        return False
    created = import_vpn_definitions(api, vpn, definitions)
    deleted = carry_out_deletions(api, vpn, stored.changes, definitions)
    log.info(
        "config-sync: VPN %s: the stored definitions and %d topology changes streamed after "
        "them imported into the local broker%s%s",
        vpn,
        len(stored.changes),
        " (vhost created)" if created else "",
        f" ({deleted} deleted objects removed)" if deleted else "",
    )
    return True
