"""Config-sync's document and its import (bridge/broker/_configsync.py),
against an in-memory management API: no servers.

Which users and permissions travel with a VPN (only those on its vhost),
how the standby brings its broker in line (the active's hash wins, the
standby's own user is never touched, nothing is written when nothing
changed) and that no password hash reaches a log line. The real brokers
are in ``tests/two_sites/test_config_sync.py``.
"""

from __future__ import annotations

import json
import logging
from typing import Any
from urllib.parse import unquote

import pytest

from bridge.broker import (
    SYNCED_TAG,
    ConfigSyncError,
    ManagementAPI,
    ManagementUnavailable,
    import_vpn_definitions,
    shape_vpn_definitions,
    split_vpn_definitions,
    vpn_definitions,
)

VPN = "orders"
HASH_A = "aGFzaC1vZi1hbGljZS1vbi10aGUtYWN0aXZl"
HASH_OLD = "b2xkLWhhc2gtb2YtYWxpY2UtaGVyZQ=="
HASH_G = "Z3Vlc3QtaGFzaC1vbi10aGUtYWN0aXZl"
SHA256 = "rabbit_password_hashing_sha256"


def user(name: str, password_hash: str, tags: Any = (), **extra: Any) -> dict[str, Any]:
    found = {"name": name, "password_hash": password_hash, "hashing_algorithm": SHA256}
    return {**found, "tags": list(tags) if not isinstance(tags, str) else tags, **extra}


def perm(name: str, vhost: str = VPN, configure: str = ".*") -> dict[str, str]:
    return {"user": name, "vhost": vhost, "configure": configure, "write": ".*", "read": ".*"}


def topic(name: str, vhost: str = VPN, exchange: str = "amq.topic") -> dict[str, str]:
    return {"user": name, "vhost": vhost, "exchange": exchange, "write": "eu.*", "read": ".*"}


class FakeBroker(ManagementAPI):
    """A management API in memory: users, vhosts, (topic) permissions and the
    definitions imported per vhost; records every write."""

    def __init__(
        self, *, keep_users: tuple[str, ...] = (), copy_tags: tuple[str, ...] = ()
    ) -> None:
        super().__init__(
            "http://guest:secret@broker.example:15672/",
            keep_users=keep_users,
            copy_tags=copy_tags,
        )
        self.users: dict[str, dict[str, Any]] = {}
        self.vhosts: set[str] = {"/"}
        self.permissions: list[dict[str, str]] = []
        self.topic_permissions: list[dict[str, str]] = []
        self.exports: dict[str, dict[str, Any]] = {}
        self.imported: dict[str, list[dict[str, Any]]] = {}
        self.writes: list[tuple[str, str]] = []
        self.reads: list[str] = []

    def _missing(self, method: str, path: str) -> ManagementUnavailable:
        return ManagementUnavailable(f"{method} /api/{path}: HTTP 404", 404)

    def get(self, path: str) -> object:
        self.reads.append(path)
        parts = [unquote(p) for p in path.split("/")]
        match parts:
            case ["definitions", vhost] if vhost in self.vhosts:
                return self.exports.get(vhost, {"queues": [], "exchanges": []})
            case ["vhosts", vhost, "permissions"]:
                return [p for p in self.permissions if p["vhost"] == vhost]
            case ["vhosts", vhost, "topic-permissions"]:
                return [t for t in self.topic_permissions if t["vhost"] == vhost]
            case ["users", name] if name in self.users:
                return json.loads(json.dumps(self.users[name]))
        raise self._missing("GET", path)

    def _call(self, method: str, path: str, body: bytes | None = None) -> bytes:
        if method == "GET":
            parts = path.split("/")
            if parts[0] == "vhosts" and unquote(parts[1]) in self.vhosts:
                return b"{}"
            raise self._missing(method, path)
        self.writes.append((method, path))
        doc: Any = json.loads(body) if body else None
        parts = [unquote(p) for p in path.split("/")]
        match method, parts:
            case "PUT", ["vhosts", vhost]:
                self.vhosts.add(vhost)
            case "POST", ["definitions", vhost]:
                self.imported.setdefault(vhost, []).append(doc)
            case "PUT", ["users", name]:
                old = self.users.get(name, {})
                self.users[name] = {
                    "name": name,
                    **doc,
                    "tags": [t for t in doc["tags"].split(",") if t],
                    "limits": old.get("limits", {}),
                }
            case "PUT", ["permissions", vhost, name]:
                self.permissions = [
                    p for p in self.permissions if (p["vhost"], p["user"]) != (vhost, name)
                ]
                self.permissions.append({"user": name, "vhost": vhost, **doc})
            case "PUT", ["topic-permissions", vhost, name]:
                self.topic_permissions = [
                    t
                    for t in self.topic_permissions
                    if (t["vhost"], t["user"], t["exchange"]) != (vhost, name, doc["exchange"])
                ]
                self.topic_permissions.append({"user": name, "vhost": vhost, **doc})
            case "PUT", ["user-limits", name, key]:
                self.users[name]["limits"][key] = doc["value"]
            case "DELETE", ["user-limits", name, key]:
                del self.users[name]["limits"][key]
            case _:
                raise AssertionError(f"unexpected {method} {path}")
        return b""


def active_broker() -> FakeBroker:
    """Site A: alice (orders and billing), bob (billing only), guest (all)."""
    a = FakeBroker()
    a.users = {
        "alice": user("alice", HASH_A, ["monitoring"], limits={"max-connections": 5}),
        "bob": user("bob", "Ym9i"),
        "guest": user("guest", HASH_G, ["administrator"]),
    }
    a.vhosts |= {VPN, "billing"}
    a.permissions = [
        perm("alice", configure=""),
        perm("alice", "billing"),
        perm("bob", "billing"),
        perm("guest"),
        perm("guest", "billing"),
    ]
    a.topic_permissions = [topic("alice"), topic("alice", "billing"), topic("bob", "billing")]
    a.exports[VPN] = {"rabbit_version": "3.10.8", "queues": [{"name": "orders.q1"}]}
    return a


# ---------------------------------------------------------------- the document


def test_only_the_users_with_a_permission_on_the_vhost_and_their_access_to_it_travel() -> None:
    users = {
        "alice": user("alice", HASH_A, "monitoring,management", limits={}, extra="dropped"),
        "guest": user("guest", HASH_G, ["administrator"]),
        "bob": user("bob", "Ym9i"),
    }
    permissions = [perm("guest"), perm("bob", "billing"), perm("alice"), perm("carol")]
    topics = [topic("alice"), topic("alice", "billing"), topic("bob"), topic("carol")]
    export = {"queues": [{"name": "q"}], "users": ["not", "these"]}

    doc = shape_vpn_definitions(VPN, export, permissions, topics, users)

    assert doc["queues"] == [{"name": "q"}]
    # carol holds a permission but is gone (deleted meanwhile): left out with it
    assert [u["name"] for u in doc["users"]] == ["alice", "guest"]
    assert doc["users"][0] == {
        "name": "alice",
        "password_hash": HASH_A,
        "hashing_algorithm": SHA256,
        "tags": ["management", "monitoring"],
        "limits": {},
    }
    assert "limits" not in doc["users"][1]  # not in what the broker gave: not invented
    assert doc["permissions"] == [perm("alice"), perm("guest")]
    # bob's topic permission on the vhost goes without him (he has no permission on it)
    assert doc["topic_permissions"] == [topic("alice")]


def test_the_active_document_reads_only_the_vhost_holders_and_is_deterministic() -> None:
    a = active_broker()
    first = vpn_definitions(a, VPN)
    assert vpn_definitions(a, VPN) == first
    doc = json.loads(first)
    assert [u["name"] for u in doc["users"]] == ["alice", "guest"]
    assert {p["vhost"] for p in doc["permissions"]} == {VPN}
    assert doc["topic_permissions"] == [topic("alice")]
    assert doc["queues"] == [{"name": "orders.q1"}]
    assert doc["users"][0]["limits"] == {"max-connections": 5}
    assert "users/bob" not in a.reads  # bob has nothing on the vhost: not even read


def test_a_user_deleted_while_the_document_is_made_goes_with_its_permissions() -> None:
    a = active_broker()
    del a.users["alice"]  # its permissions are still listed (a race with a delete)
    doc = json.loads(vpn_definitions(a, VPN))
    assert [u["name"] for u in doc["users"]] == ["guest"]
    assert [p["user"] for p in doc["permissions"]] == ["guest"]
    assert doc["topic_permissions"] == []


def test_management_failures_and_bad_answers_are_config_sync_errors() -> None:
    a = active_broker()
    a.exports[VPN] = ["not", "an", "object"]  # type: ignore[assignment]
    with pytest.raises(ConfigSyncError, match="not a JSON object"):
        vpn_definitions(a, VPN)
    with pytest.raises(ConfigSyncError, match="HTTP 404") as info:
        vpn_definitions(active_broker(), "no-such-vhost/x")
    assert isinstance(info.value.__cause__, ManagementUnavailable)


def test_the_standby_applies_access_to_its_own_vhost_only() -> None:
    doc = {
        "queues": [],
        "users": [user("alice", HASH_A)],
        "permissions": [perm("alice"), perm("alice", "billing"), perm("mallory")],
        "topic_permissions": [topic("alice", "billing"), topic("alice")],
    }
    vhost_part, access = split_vpn_definitions(VPN, json.dumps(doc).encode())
    assert json.loads(vhost_part) == {"queues": []}
    assert [p["user"] for p in access["permissions"]] == ["alice"]  # mallory is no user here
    assert "vhost" not in access["permissions"][0]  # applied to VPN, whatever it said
    assert access["topic_permissions"] == [
        {"user": "alice", "exchange": "amq.topic", "write": "eu.*", "read": ".*"}
    ]
    # an older active sends the vhost export alone
    assert split_vpn_definitions(VPN, b'{"queues": []}')[1] == {
        "users": [],
        "permissions": [],
        "topic_permissions": [],
    }
    for bad in (b"not json", b"[1, 2]", b'{"users": "alice"}', b'{"users": [{"tags": []}]}'):
        with pytest.raises(ConfigSyncError):
            split_vpn_definitions(VPN, bad)


# ---------------------------------------------------------------- the import


def test_import_creates_the_vhost_users_with_their_hashes_and_permissions(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    b = FakeBroker(copy_tags=("monitoring",))
    b.users["guest"] = user("guest", "c3RhbmRieS1ndWVzdA==", ["administrator"])
    definitions = vpn_definitions(active_broker(), VPN)

    assert import_vpn_definitions(b, VPN, definitions) is True

    assert VPN in b.vhosts
    assert b.imported[VPN] == [{"rabbit_version": "3.10.8", "queues": [{"name": "orders.q1"}]}]
    assert b.users["alice"] == {
        "name": "alice",
        "password_hash": HASH_A,
        "hashing_algorithm": SHA256,
        "tags": ["monitoring", SYNCED_TAG],  # the tags copy_tags lets through, and ours
        "limits": {"max-connections": 5},
    }
    assert "bob" not in b.users
    assert [p for p in b.permissions if p["user"] == "alice"] == [perm("alice", configure="")]
    assert b.topic_permissions == [topic("alice")]
    # the standby's own API user: its hash, tags and permissions are this site's
    assert b.users["guest"]["password_hash"] == "c3RhbmRieS1ndWVzdA=="
    assert ("PUT", "users/guest") not in b.writes
    assert [p for p in b.permissions if p["user"] == "guest"] == [perm("guest")]  # vhost creation
    texts = [r.getMessage() for r in caplog.records]
    assert sum("left as they are here" in t and "guest" in t for t in texts) == 1
    assert any("user alice created from the active" in t for t in texts)
    for text in texts:
        assert HASH_A not in text and HASH_G not in text and "secret" not in text


def test_a_user_config_sync_made_follows_the_active_and_a_relist_writes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    a = active_broker()
    b = FakeBroker()
    b.vhosts.add(VPN)
    b.users["alice"] = user(
        "alice", HASH_OLD, ["monitoring", SYNCED_TAG], limits={"max-channels": 3}
    )
    b.permissions = [perm("alice")]

    assert import_vpn_definitions(b, VPN, vpn_definitions(a, VPN)) is False
    assert b.users["alice"]["password_hash"] == HASH_A
    assert b.users["alice"]["tags"] == [SYNCED_TAG]  # no copy_tags: no tag of the active's
    assert b.users["alice"]["limits"] == {"max-connections": 5}
    assert [p for p in b.permissions if p["user"] == "alice"] == [perm("alice", configure="")]

    b.writes.clear()
    for _ in range(3):
        import_vpn_definitions(b, VPN, vpn_definitions(a, VPN))
    assert b.writes == [("POST", "definitions/orders")] * 3  # the topology import only
    kept = [r for r in caplog.records if "left as they are here" in r.getMessage()]
    assert len(kept) == 1

    a.users["alice"]["password_hash"] = "bmV3LWhhc2g="  # a new password on the active
    import_vpn_definitions(b, VPN, vpn_definitions(a, VPN))
    assert b.users["alice"]["password_hash"] == "bmV3LWhhc2g="
    assert all("bmV3LWhhc2g=" not in r.getMessage() for r in caplog.records)


def test_config_sync_copies_no_power_and_overwrites_no_user_of_this_site(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An administrator on the active arrives without its tag; a user the
    standby made itself keeps its password and tags (logged once)."""
    caplog.set_level(logging.INFO)
    a = active_broker()
    a.users["alice"]["tags"] = ["administrator", "monitoring"]
    b = FakeBroker(copy_tags=("monitoring",))
    b.vhosts.add(VPN)
    assert import_vpn_definitions(b, VPN, vpn_definitions(a, VPN)) is False
    assert b.users["alice"]["tags"] == ["monitoring", SYNCED_TAG]

    c = FakeBroker()
    c.vhosts.add(VPN)
    c.users["alice"] = user("alice", HASH_OLD, ["policymaker"])
    for _ in range(2):
        import_vpn_definitions(c, VPN, vpn_definitions(a, VPN))
    assert c.users["alice"]["password_hash"] == HASH_OLD
    assert c.users["alice"]["tags"] == ["policymaker"]
    assert c.not_ours == {"alice"}
    left = [r for r in caplog.records if "config-sync did not create it" in r.getMessage()]
    assert len(left) == 1

    # a copy an earlier release made (the active's very hash, no mark, the
    # administrator tag copied then): config-sync's now, its power gone
    d = FakeBroker()
    d.vhosts.add(VPN)
    d.users["alice"] = user("alice", HASH_A, ["administrator", "monitoring"])
    import_vpn_definitions(d, VPN, vpn_definitions(a, VPN))
    assert d.users["alice"]["tags"] == [SYNCED_TAG] and not d.not_ours


def test_keep_users_are_never_touched() -> None:
    b = FakeBroker(keep_users=("alice",))
    assert b.keep_users == {"guest", "alice"}
    import_vpn_definitions(b, VPN, vpn_definitions(active_broker(), VPN))
    assert "alice" not in b.users
    assert not [p for p in b.permissions if p["user"] == "alice"]
    assert not b.topic_permissions


def test_a_broker_that_fails_mid_import_is_a_config_sync_error() -> None:
    class Failing(FakeBroker):
        def _call(self, method: str, path: str, body: bytes | None = None) -> bytes:
            if path.startswith("users/"):
                raise ManagementUnavailable(f"{method} /api/{path}: HTTP 500", 500)
            return super()._call(method, path, body)

    with pytest.raises(ConfigSyncError, match="HTTP 500"):
        import_vpn_definitions(Failing(), VPN, vpn_definitions(active_broker(), VPN))
