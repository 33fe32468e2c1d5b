"""FedFR's public set D_g as the coordinator serves it: one file, checked once, announced by hash.

The coordinator reads the file at start (refusing one that is not a public set), and every round
configuration names its URL, sha256 and size; devices fetch it once over HTTP (`GET /public-set`)
and check it against the signed hash (`edge_client.public_set`). The route is open, like
`/health`: D_g holds public faces of nobody's people by definition, and devices hold no API token.
"""
from __future__ import annotations

from pathlib import Path

from models.public_set import load_public_set, sha256_of

ROUTE = "/public-set"
UNREACHABLE_HOSTS = {"0.0.0.0", "::", ""}


def public_set_url(http_host: str, http_port: int, public_url: str | None) -> str:
    """Where devices fetch D_g: `public_url` when given (behind a proxy, or a wildcard bind), else this server."""
    if public_url:
        return public_url
    if http_host in UNREACHABLE_HOSTS:
        raise ValueError(f"devices cannot fetch the public set from --http-host {http_host!r}; give --public-url "
                         f"http://ADDRESS:{http_port}{ROUTE} with an address the devices reach")
    host = f"[{http_host}]" if ":" in http_host else http_host
    return f"http://{host}:{http_port}{ROUTE}"


def announce_public_set(path: Path, url: str) -> dict:
    """The round configuration's `public_set` part that announces the file at `path` (read once here, so a bad file
    stops the coordinator at start rather than every device at every round)."""
    public = load_public_set(path)
    size = Path(path).stat().st_size
    labelled = "labelled" if public.labels is not None else "unlabelled"
    print(f"public set {path}: {len(public)} faces ({labelled}), served at {url}", flush=True)
    return {"public_set": {"url": url, "sha256": sha256_of(Path(path)), "size_bytes": size}}
