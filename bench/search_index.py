"""search_archive's index against a scan: what one search costs with the SQLite FTS5 index, and what it
would cost to read every archived text from Redis instead (docs/serve.md, "Searching the archive").

    python bench/search_index.py [--outputs 300] [--dumps 5]

Builds an archive of ``--outputs`` texts of 8,000 characters and ``--dumps`` of 200,000 (random words
from a 5,000-word vocabulary, seeded), then prints: the time to build the index at the first search,
literal and regular-expression searches through it, a scan through a local redis-server (one HGETALL,
each text checked against its sha256, then searched), and the HKEYS that keeps the index in step.
Needs the redis extra and ``redis-server`` on PATH.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import re
import shutil
import socket
import subprocess
import tempfile
import time

from ctxfold.compaction.archive import ArchiveStore, SearchResult, search


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outputs", type=int, default=300)
    ap.add_argument("--dumps", type=int, default=5)
    args = ap.parse_args()
    import redis

    rng = random.Random(1)
    words = [f"w{k}" for k in range(5000)] + ["error", "pytest", "import", "def", "FAILED", "src/app.py"]

    def text(num_chars: int) -> str:
        return " ".join(rng.choice(words) for _ in range(num_chars // 6))

    docs = [text(8000) for _ in range(args.outputs)] + [text(200_000) for _ in range(args.dumps)]
    folder = tempfile.mkdtemp()
    try:
        store = ArchiveStore(os.path.join(folder, "archive"))
        for doc in docs:
            store.put(doc)
        print(f"archive: {len(docs)} texts, {sum(map(len, docs)) / 1e6:.1f} M characters")
        t0 = time.perf_counter()
        search(store, "w4999 w1")
        print(f"index built at the first search: {(time.perf_counter() - t0) * 1000:.0f} ms")
        for query, regex in [("w4999 w1", False), ("src/app.py", False), ("zzzz-nothing", False),
                             (r"w49\d\d w1\d", True)]:
            t0 = time.perf_counter()
            for _ in range(10):
                got = search(store, query, regex=regex)
            assert isinstance(got, SearchResult)
            print(f"search {query!r} (regex={regex}): {(time.perf_counter() - t0) * 100:.1f} ms, "
                  f"{got.num_matching} matching texts")
    finally:
        shutil.rmtree(folder)

    port = _free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        client.hset("blobs", mapping={f"archive/{hashlib.sha256(d.encode()).hexdigest()}.txt": d.encode()
                                      for d in docs})
        pattern = re.compile(re.escape("src/app.py"), re.IGNORECASE)
        t0 = time.perf_counter()
        for _ in range(10):
            matching = 0
            for name, data in client.hgetall("blobs").items():
                if hashlib.sha256(data).hexdigest() != name.decode()[len("archive/"):-len(".txt")]:
                    raise SystemExit(f"corrupt blob {name!r}")
                matching += pattern.search(data.decode()) is not None
        print(f"scan through Redis ('src/app.py'): {(time.perf_counter() - t0) * 100:.1f} ms, {matching} matching texts")
        t0 = time.perf_counter()
        for _ in range(10):
            client.hkeys("blobs")
        print(f"HKEYS of the archive (the index's step check): {(time.perf_counter() - t0) * 100:.2f} ms")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
