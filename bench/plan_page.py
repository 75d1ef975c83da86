"""How fast the planner page answers: wall time of GET /api/plan over HTTP on 127.0.0.1 (server in
this process), per query: a new question (a fresh server, so its answer cache is empty; median and
slowest of REPEATS) and the same question again (answered from the server's cache). What a keystroke
in the page waits for, the 250 ms debounce aside. Run: python bench/plan_page.py [REPEATS]"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import urllib.request
from urllib.parse import urlencode

from finetune.cli.plan import page_answer
from finetune.plan import serve

QUERIES = ["llama-70b qlora on 2x RTX 4090", "llama-2-70b on 2xA100-40GB", "what fits on 2×A100 40GB"]


def ask(url: str) -> tuple[float, int]:
    started = time.perf_counter()
    with urllib.request.urlopen(url) as response:
        size = len(response.read())
    return (time.perf_counter() - started) * 1000, size


def main(repeats: int) -> None:
    print(f"{'query':<34} {'new: median ms':>15} {'max ms':>7} {'again: ms':>10} {'KiB':>5}")
    for query in QUERIES:
        fresh, again = [], []
        for _ in range(repeats):
            server = serve.start("127.0.0.1", 0, page_answer)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            url = f"http://127.0.0.1:{server.server_address[1]}/api/plan?{urlencode({'q': query})}"
            elapsed, size = ask(url)
            fresh.append(elapsed)
            again.append(ask(url)[0])
            server.shutdown()
            server.server_close()
        print(f"{query:<34} {statistics.median(fresh):>15.0f} {max(fresh):>7.0f} {statistics.median(again):>10.1f} {size / 1024:>5.0f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("repeats", nargs="?", type=int, default=10, help="fresh servers per query (default 10)")
    main(parser.parse_args().repeats)
