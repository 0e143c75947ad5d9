"""The chat playground: one offline page and its two assets, served without a token (the page asks for one).

Only GET and HEAD on exactly these paths skip the token check; every other method on them (TGI's ``POST /``
among them) still goes through the authenticated catch-all route.
"""

from __future__ import annotations

from pathlib import Path

from flask import Flask, Response, request

FOLDER = Path(__file__).resolve().parent / "playground"
PAGES = ("/", "/playground")
ASSETS = {
    "/playground/style.css": ("style.css", "text/css; charset=utf-8"),
    "/playground/app.js": ("app.js", "text/javascript; charset=utf-8"),
}
# the page may load and call only its own origin: nothing from another host, no inline script
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def register_playground(app: Flask) -> None:
    files = {path: ((FOLDER / "index.html").read_bytes(), "text/html; charset=utf-8") for path in PAGES}
    files.update({path: ((FOLDER / name).read_bytes(), mimetype) for path, (name, mimetype) in ASSETS.items()})

    def serve() -> Response:
        body, mimetype = files[request.path]
        response = Response(body, content_type=mimetype, headers=HEADERS)
        response.add_etag()
        response.make_conditional(request)  # (in place: it returns the response itself)
        return response

    for path in files:
        app.add_url_rule(
            path,
            endpoint=f"playground:{path}",
            view_func=serve,
            methods=["GET", "HEAD"],
            provide_automatic_options=False,
        )
