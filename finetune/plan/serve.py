"""`finetune plan --serve`: the planner as a local web page, and `--html`: the same page as one file.

The standard library's ThreadingHTTPServer serves three static files (finetune/plan/page/, read once
at start) and a JSON API; the planner is torch-free, so an answer takes milliseconds. What a request
means (form fields → flags → plans) is the caller's `answer` function: `finetune plan`'s command
module owns the flags, this module owns HTTP.

Safe by default: binds 127.0.0.1 unless told otherwise, answers only requests addressed to the host
names it was bound for (a Host header naming another site is how a page in the same browser reaches
a local server by DNS rebinding: 421), refuses bodies and URLs above a few kB with 413, serves only
the files listed in STATIC (no path from a request reaches the disk), and never runs model code (a
pasted config.json is parsed as JSON by the answer function).
"""

from __future__ import annotations

import ipaddress
import json
import socket
import sys
import traceback
from collections.abc import Callable
from functools import cache, lru_cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qsl, urlencode, urlsplit

from finetune.config.names import METHODS, OFFLOADS, OPTIMIZERS, PRECISIONS, STRATEGIES
from finetune.config.objectives import OBJECTIVES
from finetune.errors import FinetuneError
from finetune.models import catalog as model_catalog
from finetune.plan import gpus as gpu_catalog
from finetune.plan.params import count_params

# A config.json is 1-3 kB and a query a line; anything far larger is not a planning request.
MAX_BODY_BYTES = 64 * 1024
MAX_URL_BYTES = 8 * 1024
# answers kept per server; a "what fits" answer is ~0.3 MB of JSON
ANSWER_CACHE = 32
# Memory sizes the GPU menu offers besides the catalog (a card given by its memory: plan.gpus.by_memory)
MEMORY_SIZES_GIB = (8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 128, 192, 256)
# URL path → (file in finetune/plan/page/, content type). Nothing else is served.
STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/page.css": ("page.css", "text/css; charset=utf-8"),
    "/page.js": ("page.js", "text/javascript; charset=utf-8"),
}
# The page loads only its own files and talks only to this server.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

# form fields (named as the flags, without dashes) → (HTTP status, JSON body)
Answer = Callable[[dict[str, str]], tuple[int, dict]]


@cache
def page_file(name: str) -> str:
    """A file of the page, from the installed package."""
    return (resources.files("finetune.plan") / "page" / name).read_text(encoding="utf-8")


@cache
def catalog() -> dict:
    """What the form's menus offer: catalog models and GPUs, memory sizes for any other card, and each
    flag's choices."""
    return {
        "models": [{"name": name, "params_b": round(count_params(spec).total / 1e9, 2)}
                   for name, spec in model_catalog.REAL_MODELS.items()],
        "gpus": [{"name": name, "memory_gib": spec.memory_gib} for name, spec in gpu_catalog.GPUS.items()],
        "memory_sizes": list(MEMORY_SIZES_GIB),
        "choices": {"method": list(METHODS), "strategy": list(STRATEGIES), "offload": list(OFFLOADS),
                    "precision": list(PRECISIONS), "optimizer": list(OPTIMIZERS), "objective": list(OBJECTIVES)},
        "strategy_labels": {name: strategy.label for name, strategy in STRATEGIES.items()},
    }


def standalone_html(data: dict) -> str:
    """The page with its CSS, JS and one answer inlined: opens from a file, without network."""
    html = page_file("index.html")
    data_script = f"window.PLAN_DATA = {_script_json(data)};\nwindow.PLAN_CATALOG = {_script_json(catalog())};"
    html = html.replace('<link rel="stylesheet" href="page.css">', f"<style>\n{page_file('page.css')}</style>")
    return html.replace('<script src="page.js"></script>', f"<script>{data_script}</script>\n<script>\n{page_file('page.js')}</script>")


def _script_json(value: dict) -> str:
    """JSON for inside <script>: "<" as \\u003c, so no text in it can close the element."""
    return json.dumps(value).replace("<", "\\u003c")


class PlanHandler(BaseHTTPRequestHandler):
    """GET / and its two assets, GET /api/catalog, GET or POST /api/plan (fields as a query string or
    a JSON object). Every answer is JSON except the static files."""

    server_version = "finetune-plan"
    answer: Answer  # set by `handler_for`
    host_names: frozenset[str]  # set by `handler_for`: names besides IP literals the Host header may give

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if not self._addressed_to_us():
            return
        if len(self.path) > MAX_URL_BYTES:
            return self._send_json(413, _error(f"URL longer than {MAX_URL_BYTES} bytes"))
        url = urlsplit(self.path)
        if url.path == "/api/plan":
            return self._answer(dict(parse_qsl(url.query, keep_blank_values=True)))
        if url.path == "/api/catalog":
            return self._send_json(200, catalog())
        if url.path in STATIC:
            name, content_type = STATIC[url.path]
            return self._send(200, page_file(name).encode(), content_type)
        self._send_json(404, _error(f"no page at {url.path}"))

    def do_POST(self) -> None:  # noqa: N802
        if not self._addressed_to_us():
            return
        if urlsplit(self.path).path != "/api/plan":
            return self._send_json(404, _error("POST goes to /api/plan"))
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            return self._send_json(411, _error("send a Content-Length"))
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY_BYTES:
            self.close_connection = True  # the unread body must not be parsed as the next request
            return self._send_json(413, _error(f"request body over {MAX_BODY_BYTES} bytes"))
        try:
            fields = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            return self._send_json(400, _error("the body is not JSON"))
        if not isinstance(fields, dict) or not all(isinstance(v, str) for v in fields.values()):
            return self._send_json(400, _error("send a JSON object of strings, one per field"))
        self._answer(fields)

    def _addressed_to_us(self) -> bool:
        """An IP literal or a name the server was bound for: a rebound name (an attacker's domain that
        now resolves to 127.0.0.1) is neither. Sends 421 and returns False otherwise."""
        name = urlsplit(f"//{self.headers.get('Host', '')}").hostname or ""
        if is_ip_literal(name) or name in type(self).host_names:
            return True
        self._send_json(421, _error(f"this server answers requests for {', '.join(sorted(type(self).host_names))} "
                                    "or its IP addresses, not for the Host header sent"))
        return False

    def _answer(self, fields: dict[str, str]) -> None:
        try:
            status, body = type(self).answer(fields)
        except Exception:  # a bug must cost one answer, not the server
            traceback.print_exc()
            status, body = 500, _error("internal error (see the server's terminal)")
        self._send_json(status, body)

    def _send_json(self, status: int, body: dict) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: int, payload: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args) -> None:
        """Quiet: the terminal shows the address and errors, not one line per keystroke."""


def _error(message: str) -> dict:
    return {"errors": [{"field": None, "message": message}]}


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_names(host: str) -> frozenset[str]:
    """The names a request may address the server by when it listens on `host`: localhost, the
    --host name itself, and this machine's names when it listens on every interface."""
    names = {"localhost", host.lower()}
    if is_ip_literal(host) and ipaddress.ip_address(host).is_unspecified:
        names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
    return frozenset(name for name in names if not is_ip_literal(name))


def handler_for(answer: Answer, names: frozenset[str]) -> type[PlanHandler]:
    """A handler class that answers requests addressed to `names` (or an IP) with `answer`, remembering
    the last ANSWER_CACHE answers: the planner is a pure function of the fields, and a page often asks
    again (undo, back, a shared link)."""
    @lru_cache(maxsize=ANSWER_CACHE)
    def remembered(key: tuple[tuple[str, str], ...]) -> tuple[int, dict]:
        return answer(dict(key))

    return type("BoundPlanHandler", (PlanHandler,), {
        "answer": staticmethod(lambda fields: remembered(tuple(sorted(fields.items())))), "host_names": names})


def start(host: str, port: int, answer: Answer) -> ThreadingHTTPServer:
    """A bound server (port 0: a free one), not yet serving; call serve_forever()."""
    try:
        server = ThreadingHTTPServer((host, port), handler_for(answer, host_names(host)))
    except (OSError, OverflowError) as e:  # OverflowError: a port outside 0-65535
        why = str(getattr(e, "strerror", None) or e).rstrip(".")
        raise FinetuneError(f"Cannot listen on {host}:{port}: {why}. Pick another --host or --port.") from e
    server.daemon_threads = True
    return server


def run(host: str, port: int, answer: Answer, query: str = "") -> int:
    """Serve until Ctrl-C; the address printed opens the page on `query` when one is given."""
    server = start(host, port, answer)
    bound_host, bound_port = server.server_address[:2]
    opening = f"?{urlencode({'q': query})}" if query else ""
    print(f"finetune plan: serving the planner on http://{bound_host}:{bound_port}/{opening} (Ctrl-C stops)", file=sys.stderr)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print("finetune plan: --host makes the page reachable from other machines", file=sys.stderr)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
