"""A web app's back-end for the page: it holds `serve`'s API key, and for each of its users
that opens ``/start`` it mints a short-lived client secret (``POST /v1/realtime/client_secrets``)
and sends the browser on to the page with the secret in the address's fragment
(``https://voice.example/#secret=ek_...``). A fragment never reaches a server or its logs; the
page takes the secret out of the address bar and connects with it, once. The key itself never
leaves this process.

    VOICECHAT_API_KEY=KEY VOICECHAT_LOGIN=user:password \\
        python examples/client_secret_backend.py --server http://127.0.0.1:8000 \\
        --page https://voice.example/ [--host 127.0.0.1] [--port 8080] \\
        [--instructions "Be brief."] [--ttl 120] [--ssl-certfile CERT --ssl-keyfile KEY]

``--server`` is where this back-end reaches `serve` (its own network: often 127.0.0.1);
``--page`` is the page's address as the user's browser sees it (default: ``--server`` + ``/``).
``GET /start`` redirects (303) to the page with a fresh secret; ``GET /secret`` answers the
secret as JSON (``{"value", "expires_at"}``) for a page of your own that fetches one. Both ask
for the login (HTTP Basic, ``VOICECHAT_LOGIN``): whoever gets a secret gets a conversation, so
put your app's own sign-in here. Serve this over TLS (``--ssl-certfile``, or behind the same
reverse proxy as `serve`): the login and the secret travel in it. docs/webrtc.md, "Serving the
page to other machines", has the whole set-up. Only the standard library.
"""

from __future__ import annotations

import argparse
import base64
import hmac
import json
import os
import ssl
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def mint(server: str, key: str, session: dict, seconds: int) -> dict:
    """A client secret from `serve` (``{"value", "expires_at", "session"}``)."""
    body = {"expires_after": {"anchor": "created_at", "seconds": seconds}, "session": session}
    request = urllib.request.Request(
        server.rstrip("/") + "/v1/realtime/client_secrets",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = json.loads(e.read() or b"{}").get("error", {}).get("message", "")
        raise RuntimeError(f"serve refused to mint a client secret ({e.code}): {detail}") from None
    except (OSError, ValueError) as e:
        raise RuntimeError(f"could not reach serve at {server}: {e}") from None


def make_server(host, port, *, server, page, key, login, session=None, ttl=120):
    """The back-end's HTTP server (not started): ``serve_forever()`` runs it."""
    session = dict(session or {})
    expected = "Basic " + base64.b64encode(login.encode()).decode()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status, body=b"", kind="text/plain; charset=utf-8", headers=()):
            self.send_response(status)
            for name, value in [("Cache-Control", "no-store"), ("Referrer-Policy", "no-referrer")]:
                self.send_header(name, value)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            path = self.path.split("?")[0]
            if path not in ("/start", "/secret"):
                return self._answer(404, b"not found: /start or /secret\n")
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), expected.encode()):
                realm = [("WWW-Authenticate", 'Basic realm="voicechat"')]
                return self._answer(401, b"sign in first\n", headers=realm)
            try:
                secret = mint(server, key, session, ttl)
            except RuntimeError as e:
                return self._answer(502, f"{e}\n".encode())
            if path == "/secret":
                body = {"value": secret["value"], "expires_at": secret["expires_at"]}
                return self._answer(200, json.dumps(body).encode(), "application/json")
            to = page.split("#")[0] + "#secret=" + secret["value"]
            return self._answer(303, b"", headers=[("Location", to)])

    return ThreadingHTTPServer((host, port), Handler)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", required=True, help="serve's base URL, as this host sees it")
    parser.add_argument("--page", help="the page's URL as browsers see it (default: --server/)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--instructions", help="the session's instructions, set by the back-end")
    parser.add_argument("--ttl", type=int, default=120, help="seconds a secret lives (10..7200)")
    parser.add_argument("--ssl-certfile")
    parser.add_argument("--ssl-keyfile")
    args = parser.parse_args(argv)
    key, login = os.environ.get("VOICECHAT_API_KEY"), os.environ.get("VOICECHAT_LOGIN", "")
    if not key:
        parser.error("set VOICECHAT_API_KEY to serve's --api-key (it stays in this process)")
    if ":" not in login:
        parser.error("set VOICECHAT_LOGIN=user:password (who may get a secret)")
    session = {"instructions": args.instructions} if args.instructions else {}
    page = args.page or args.server.rstrip("/") + "/"
    httpd = make_server(
        args.host,
        args.port,
        server=args.server,
        page=page,
        key=key,
        login=login,
        session=session,
        ttl=args.ttl,
    )
    scheme = "http"
    if args.ssl_certfile:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
        scheme = "https"
    print(f"open {scheme}://{args.host}:{httpd.server_address[1]}/start (page: {page})")
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
