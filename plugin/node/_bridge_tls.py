"""The bridge's TLS on a running node: the warning a plain TCP bridge earns,
and SIGHUP's reading of ``[tls]`` and ``[insecure]`` again without a restart.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from bridge.active import ActiveBridge
from bridge.link import TlsSetupError, make_client_context, make_server_context
from bridge.standby import StandbyBridge
from plugin._errors import ConfigError
from plugin.config import SiteConfig, load_config

__all__ = ["reload_bridge_tls", "warn_plaintext"]

log = logging.getLogger("vpnrepl.node")


def warn_plaintext(cfg: SiteConfig) -> None:
    if cfg.bridge_moving:
        log.warning(
            "the bridge takes and dials plain TCP beside mutual TLS ([tls] and "
            "[insecure] plaintext_bridge = true: the pair is moving to TLS); remove "
            "plaintext_bridge once both sites have [tls]"
        )
    elif cfg.plaintext_bridge:
        log.warning(
            "the bridge is plain TCP ([insecure] plaintext_bridge = true): peers are not "
            "authenticated and replicated messages cross the network readable; set "
            "[tls] cert, key and ca (`vpnrepl tls init`) to end this"
        )


def reload_bridge_tls(
    cfg: SiteConfig, ends: tuple[ActiveBridge | None, StandbyBridge | None]
) -> SiteConfig | None:
    """The config file's ``[tls]`` and ``[insecure]`` and the certificate,
    key and CA files are read again — a rotation, or a step of the move to
    TLS (README "Moving a plaintext pair to mutual TLS") — and handed to
    the bridge's ``ends``: new links use them; a plain TCP link that is no
    longer allowed is dropped (the standby dials again). Returns ``cfg``
    with them; None when a file or the config is unusable (logged: the
    bridge stays as it was)."""
    try:
        fresh = load_config(cfg.path, cfg.overrides)
        tls, plaintext = fresh.tls, fresh.plaintext_bridge
        if tls is not None:  # both contexts first: the ends switch together or not at all
            make_server_context(tls)
            make_client_context(tls)
        for end in ends:
            if end is not None:
                end.reload_tls(tls, plaintext)
    except (TlsSetupError, ConfigError) as e:
        log.error("SIGHUP: the bridge stays as it was: %s", e)
        return None
    cfg = replace(cfg, tls=tls, plaintext_bridge=plaintext)
    warn_plaintext(cfg)
    log.info(
        "SIGHUP: the bridge's TLS read again (%s; new links use it)",
        "certificate " + str(tls.cert) if tls is not None else "no [tls]",
    )
    return cfg
