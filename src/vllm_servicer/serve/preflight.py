"""Before any port opens: warnings about what the addresses expose, and ports already taken.

Both launchers (`launcher.py`, `api_servers.py`) ask this before they start
the engine, so that a taken port costs no model load.
"""

from __future__ import annotations

import logging

from ..options import port_in_use
from ..proto import CONTROL_SERVICE
from ..tls import is_loopback, warn_if_exposed
from .args import ADMIN_KEY_ENV, ServeArgs

__all__ = ["CONTROL_ALLOWS", "addresses_usable", "announce_control", "listening_addresses"]

logger = logging.getLogger("vllm_servicer.serve")


def listening_addresses(args: ServeArgs) -> list[tuple[str, str, int]]:
    """(flag, host, port) of each port the launcher listens on (port 0: any free one)."""
    addresses = [("--port", args.server.host, args.server.port)]
    if args.http.http_port is not None:
        addresses.append(("--http-port", args.http_address, args.http.http_port))
    if args.security.health_port is not None:
        addresses.append(("--health-port", args.server.host, args.security.health_port))
    return addresses


def addresses_usable(args: ServeArgs) -> bool:
    """Warn about exposed addresses and an unauthenticated vllm.Control; False
    (logged) when a port is already taken."""
    tls, auth = args.security.tls is not None, args.security.authenticates()
    warn_if_exposed(args.server.host, tls=tls, auth=auth)
    if args.http.http_port is not None and args.http_address != args.server.host:
        warn_if_exposed(args.http_address, tls=tls, auth=auth)
    announce_control(args)
    for flag, host, port in listening_addresses(args):
        if port_in_use(host, port):
            logger.error(
                "%s:%d is already in use (another server?); choose another %s", host, port, flag
            )
            return False
    return True


CONTROL_ALLOWS = (
    "shut the server down, sleep or pause the engine, load LoRA adapters from any "
    "directory this user can read, and point weight updates at a trainer of its own"
)
"""What a caller of vllm.Control can do, named wherever it is served without authentication."""


def announce_control(args: ServeArgs) -> None:
    """Log why vllm.Control is left out without authentication, or warn that it is served."""
    if args.security.authenticates():
        return
    if CONTROL_SERVICE not in args.options.served.services:
        if not args.services_named:
            logger.info(
                "vllm.Control is not served: without API keys or --tls-client-ca anyone "
                "who reaches the port could %s. Set keys (its methods are then for admin "
                "keys), or name it: --services vllm-engine inference control",
                CONTROL_ALLOWS,
            )
        return
    who = "any local user or process" if is_loopback(args.server.host) else "anyone"
    logger.warning(
        "serving vllm.Control without authentication (--services names it): %s who reaches "
        "%s:%d can %s. Add --admin-api-key-file (or $%s) to keep it to administrators.",
        who,
        args.server.host,
        args.server.port,
        CONTROL_ALLOWS,
        ADMIN_KEY_ENV,
    )
