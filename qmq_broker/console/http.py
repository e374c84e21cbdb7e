"""Serving the console's page: its static files from the package, with a strict
Content-Security-Policy.

The files (``static/``: one HTML page, ES modules, a stylesheet) are read once, when the
app is made, through ``importlib.resources``; a request names one of them and nothing else
(no paths, so nothing outside the package can be reached). The data comes from the JSON
API, which checks tokens; the page itself is the same for everyone.
"""

from __future__ import annotations

import dataclasses
import hashlib
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response

from qmq_broker.errors import NotFound

CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",  # no inline scripts: markup that slipped in could not run
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".txt": "text/plain; charset=utf-8",
}
INDEX = "index.html"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Asset:
    body: bytes
    media_type: str
    etag: str


def load_assets(package: str = "qmq_broker.console", folder: str = "static") -> dict[str, Asset]:
    """Every file of the package's ``folder`` with a known type, by file name."""
    assets: dict[str, Asset] = {}
    for entry in resources.files(package).joinpath(folder).iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if not entry.is_file() or suffix not in _MEDIA_TYPES:
            continue
        body = entry.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
        assets[entry.name] = Asset(body=body, media_type=_MEDIA_TYPES[suffix], etag=etag)
    if INDEX not in assets:
        raise RuntimeError(f"{package}/{folder}/{INDEX} is missing from the installation")
    return assets


class ConsoleAssets:
    """The ``/console`` routes: the page and its files."""

    def __init__(self, assets: dict[str, Asset] | None = None) -> None:
        self._assets = assets if assets is not None else load_assets()

    async def index(self, request: Request) -> Response:
        return self._serve(request, INDEX)

    async def asset(self, request: Request) -> Response:
        return self._serve(request, str(request.path_params["name"]))

    def _serve(self, request: Request, name: str) -> Response:
        asset = self._assets.get(name)
        if asset is None:
            raise NotFound(code="not_found", message=f"no console file {name!r}")
        headers = {
            "Content-Security-Policy": CONTENT_SECURITY_POLICY,
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-cache",  # revalidate: a new broker version serves new files
            "ETag": asset.etag,
        }
        if request.headers.get("if-none-match") == asset.etag:
            return Response(status_code=304, headers=headers)
        return Response(asset.body, media_type=asset.media_type, headers=headers)
