"""An OpenID Connect issuer for the S3 tests' web identity credentials, run by the test session on
127.0.0.1: an RSA key made for the session, its public half served as a JSON Web Key Set (which
SeaweedFS's STS fetches to check tokens), and RS256-signed ID tokens (the kind EKS projects into pods
for ``AWS_WEB_IDENTITY_TOKEN_FILE``)."""

from __future__ import annotations

import base64
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

AUDIENCE = "bcp-test"
"""The client ID the server's OIDC provider accepts as a token's audience."""
_KEY_ID = "bcp-test-key"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unsigned_bytes(number: int) -> bytes:
    return number.to_bytes((number.bit_length() + 7) // 8, "big")


class OidcIssuer:
    """Serves ``/jwks.json`` until :meth:`close`; :meth:`token` signs an ID token for a subject."""

    def __init__(self) -> None:
        self._key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        public = self._key.public_key().public_numbers()
        keys = {"keys": [{"kty": "RSA", "kid": _KEY_ID, "use": "sig", "alg": "RS256",
                          "n": _b64(_unsigned_bytes(public.n)), "e": _b64(_unsigned_bytes(public.e))}]}
        body = json.dumps(keys).encode()
        self.fetches = 0

        issuer = self

        class Keys(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                issuer.fetches += 1
                self.send_response(200 if self.path == "/jwks.json" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Keys)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        """The issuer (``iss``); its keys are at ``{url}/jwks.json``."""

    def token(self, subject: str = "trainer", lifetime_s: int = 3600) -> str:
        """A signed ID token for ``subject``, valid for ``lifetime_s`` seconds from now."""
        now = int(time.time())
        header = _b64(json.dumps({"alg": "RS256", "typ": "JWT", "kid": _KEY_ID}).encode())
        claims = _b64(json.dumps({"iss": self.url, "aud": AUDIENCE, "sub": subject, "iat": now,
                                  "exp": now + lifetime_s}).encode())
        signature = self._key.sign(f"{header}.{claims}".encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{header}.{claims}.{_b64(signature)}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
