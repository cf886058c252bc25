"""The validated configuration: frozen values, built by :func:`load_config`
(``plugin/config/_load.py``) and nothing else."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bridge import HostPort, TlsConfig

__all__ = ["DEFAULT_JDBC_JAR", "NodeConfig", "PeerConfig", "ReconcileConfig", "SiteConfig"]

_WILDCARDS = ("0.0.0.0", "::", "")  # noqa: S104 - listen-everywhere addresses, not binds

#: Debian's PostgreSQL JDBC driver (package libpostgresql-jdbc-java)
DEFAULT_JDBC_JAR = "/usr/share/java/postgresql.jar"


@dataclass(frozen=True, slots=True)
class ReconcileConfig:
    """``[reconcile]``: how ``vpnrepl reconcile`` runs, and whether (and how
    often) the node runs it on its own."""

    #: the node runs it for each active VPN about this often (None: never)
    interval_seconds: int | None = None
    #: scheduled runs repair what they find
    repair: bool = False
    #: ``pushdown`` (segment hashes computed in PostgreSQL) or ``jdbc``
    #: (rows read by Spark's JDBC source, hashed by Spark)
    method: str = "pushdown"
    #: the Spark master
    master: str = "local[*]"
    segments: int = 1024
    jdbc_jar: str = DEFAULT_JDBC_JAR
    #: seconds between the two broker-drift readings: more than the
    #: broker's ``collect_statistics_interval`` (5 s by default)
    drift_interval: int = 6


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """``[peers.NAME]`` (or the single ``[peer]`` with ``name``): a site this
    one replicates with, by the name its certificate and Hello carry."""

    name: str
    #: that site's bridge addresses (its nodes), dialled in this order
    bridge: tuple[HostPort, ...] = ()
    #: its database (switchover, reconciliation)
    store_dsn: str | None = None


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """``[nodes.NAME]``: one node process of the site, its listen addresses
    and the host the site's other nodes reach it at."""

    name: str
    amqp: HostPort
    bridge: HostPort
    admin: HostPort
    amqps: HostPort | None = None
    #: the host the other nodes relay to (None: the listen addresses' host)
    host: str | None = None
    max_connections: int = 10_000

    def reach(self, listen: HostPort) -> HostPort:
        """Where another node of the site connects to reach ``listen``."""
        host = self.host or listen.host
        return HostPort("127.0.0.1" if host in _WILDCARDS else host, listen.port)


@dataclass(frozen=True, slots=True)
class SiteConfig:
    """A validated site configuration."""

    path: str
    site_name: str
    #: ``broker.amqp_url``: the site's RabbitMQ nodes (one, or a cluster's),
    #: all with the same scheme and user; the listener spreads clients over
    #: them and the node's own connections move to the next when one fails
    amqp_urls: tuple[str, ...]
    #: ``broker.management_url``: the same nodes' management API
    management_urls: tuple[str, ...]
    listen_amqp: HostPort
    listen_bridge: HostPort
    listen_admin: HostPort
    store_dsn: str
    peer_bridge: HostPort | None
    tls: TlsConfig | None
    #: acknowledged ledger entries are kept this long before pruning, so a
    #: standby that reconnects within it catches up by replay, not checkpoint
    ledger_retain_seconds: int = 300
    #: past this many bytes of events the ledger is pruned even where the
    #: standby has not acknowledged it (0: no bound; ``bridge.ledger._bound``)
    ledger_max_bytes: int = 8 << 30
    #: how often that bound is checked
    ledger_check_seconds: int = 30
    #: how often the node re-reads each VPN's definitions from the broker
    topology_refresh_seconds: int = 30
    #: an OTLP/HTTP traces endpoint for the transaction spans (None: off)
    otlp_traces_url: str | None = None
    #: where AMQPS clients connect (None: no TLS listener); needs client_tls
    listen_amqps: HostPort | None = None
    #: the AMQPS listener's certificate, key and, for client certificates, CA
    client_tls: TlsConfig | None = None
    #: the CA that signed the broker's certificate, for an ``amqps://`` amqp_url
    #: (None: the system's trusted CAs)
    broker_ca: Path | None = None
    #: the peer site's database (switchover asks the active's node through
    #: it; reconciliation reads it): a role with read access is enough for
    #: reconciliation, switchover also writes operator requests
    peer_store_dsn: str | None = None
    reconcile: ReconcileConfig = ReconcileConfig()
    #: ``listen.max_connections``: client connections served at once
    max_client_connections: int = 10_000
    #: ``[configsync] copy_tags``: the user tags config-sync copies
    copy_tags: tuple[str, ...] = ()
    #: ``[admin] user`` / ``password`` / ``token``: the admin endpoint's
    #: credentials (None: none, allowed on loopback only)
    admin_user: str | None = None
    admin_password: str | None = None
    admin_token: str | None = None
    #: the peer sites, by name (``[peers.NAME]``); this release replicates
    #: with one
    peers: tuple[PeerConfig, ...] = ()
    #: ``[insecure] plaintext_bridge``: the bridge without TLS (no peer is
    #: authenticated); shown in every start's log, status and metrics. With
    #: ``[tls]`` too the pair is moving to TLS: the bridge takes and dials
    #: either (TLS first)
    plaintext_bridge: bool = False
    #: the ``--set`` overrides the file was read with (SIGHUP reads it again)
    overrides: tuple[str, ...] = ()
    #: this node's name (``node --name``; ``[nodes.NAME]``), "" for a site
    #: configured with ``[listen]`` and run without a name
    node_name: str = ""
    #: the site's nodes (``[nodes.NAME]``, in name order; empty with ``[listen]``)
    nodes: tuple[NodeConfig, ...] = ()
    #: ``[site] lease_seconds``: how long a node leads the site unrenewed;
    #: another node takes over this long after the leader stops answering
    lease_seconds: float = 15.0

    @property
    def holder(self) -> str:
        """The name this node takes the site's lease by."""
        return self.node_name or "node"

    def node(self, name: str) -> NodeConfig | None:
        """The site's node ``name`` (``[nodes.NAME]``), if configured."""
        return next((n for n in self.nodes if n.name == name), None)

    @property
    def amqp_url(self) -> str:
        """The first broker node's URL: its scheme and user are every node's."""
        return self.amqp_urls[0]

    @property
    def management_url(self) -> str:
        return self.management_urls[0]

    @property
    def peer(self) -> PeerConfig | None:
        """The peer site, if one is configured."""
        return self.peers[0] if self.peers else None

    @property
    def peer_store_key(self) -> str:
        """The dotted key of the peer's ``store_dsn``, for errors."""
        return f"peers.{self.peer.name}.store_dsn" if self.peer else "peers.NAME.store_dsn"

    @property
    def bridge_authenticated(self) -> bool:
        """Peers prove their site name with a certificate (mutual TLS), and
        no plain TCP link is admitted."""
        return self.tls is not None and self.tls.ca is not None and not self.plaintext_bridge

    @property
    def bridge_moving(self) -> bool:
        """``[tls]`` and the opt-out together: the pair moves to TLS."""
        return self.tls is not None and self.plaintext_bridge
