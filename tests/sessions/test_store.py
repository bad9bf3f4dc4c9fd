"""The session store: local directory and Redis (a real redis-server on loopback), the fenced lease, the
spool, the checkpoint, and what survives a Redis restart."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from ctxfold.chat.messages import Conversation, Message, Role, ToolCall, ToolSpec
from ctxfold.compaction.archive import (
    READ_ARCHIVE,
    SEARCH_ARCHIVE,
    ArchiveStore,
    answer_recall_call,
    content_id,
)
from ctxfold.compaction.compactor import Compactor
from ctxfold.compaction.config import CompactConfig
from ctxfold.compaction.session import Session
from ctxfold.compaction.store import (
    Batch,
    BufferedLog,
    LeaseLost,
    LocalStore,
    NoSuchSession,
    Spooled,
    SpoolFull,
    SpoolingStore,
    Store,
    StoreUnavailable,
    fold_events,
    load_events,
    open_store,
    restore_from_store,
)
from ctxfold.compaction.store.buffer import BufferedArchive
from ctxfold.compaction.store.redis_store import RedisStore, durability_problem
from ctxfold.errors import ArchiveError
from ctxfold.serve.recall import fetch_for
from ctxfold.tokens.counting import TokenCounter, load_counter
from ctxfold.tokens.templates import get_template
from helpers.redis_server import RedisServer

T = TypeVar("T")
SID = "0123456789abcdef0123456789abcdef/0000"


def run(coro: Awaitable[T]) -> T:
    async def main() -> T:
        return await coro

    return asyncio.run(main())


def with_store(url: str, fn: Callable[[Store], Awaitable[T]]) -> T:
    """``fn(store)`` on a fresh store (and event loop), closed after."""
    async def main() -> T:
        store = open_store(url)
        try:
            return await fn(store)
        finally:
            await store.close()

    return asyncio.run(main())


def header_event(seq: int = 0) -> dict[str, Any]:
    return {"seq": seq, "type": "header", "version": 1, "conversation": {"system": "sys", "tools": []}}


def append_event(seq: int, index: int, text: str) -> dict[str, Any]:
    return {"seq": seq, "type": "append", "index": index, "message": {"role": "user", "content": text}}


def events_for(texts: list[str], first_seq: int = 1, first_index: int = 0) -> tuple[dict[str, Any], ...]:
    return tuple(append_event(first_seq + k, first_index + k, t) for k, t in enumerate(texts))


@pytest.fixture(params=["local", "redis"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "sessions")
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        yield server.url


def test_an_append_that_releases_frees_the_lease_in_the_same_call(store_url: str) -> None:
    async def body(store: Store) -> None:
        lease = await store.acquire(SID, owner="a")
        assert lease is not None
        await store.append(lease, Batch(events=(header_event(),)), release=True)
        taken = await store.acquire(SID, owner="b")  # at once: no waiting for the lease to run out
        assert taken is not None and taken.token == lease.token + 1
        with pytest.raises(LeaseLost):  # the first holder's later writes are fenced out
            await store.append(lease, Batch(events=events_for(["late"])), release=True)
        await store.append(taken, Batch(events=events_for(["b"])))
        assert await store.acquire(SID, owner="c") is None  # "b" still holds it: not released by "a"
        await store.append(taken, Batch(), release=True)  # nothing to write: released all the same
        assert await store.acquire(SID, owner="c") is not None
        assert [e.get("message", {}).get("content") for e in (await store.read(SID)).events] == [None, "b"]

    with_store(store_url, body)


def test_what_a_store_remembers_of_sessions_stays_bounded(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long-running proxy serves sessions without end: a Redis client's memory of the ids it listed is
    bounded (listing one again is harmless), and a local store forgets the sessions a sweep deleted."""
    from ctxfold.compaction.store import redis_store

    monkeypatch.setattr(redis_store, "MAX_LISTED_IDS", 2)
    ids = [f"{SID[:33]}{k:04d}" for k in range(5)]

    async def body(store: Store) -> None:
        for sid in ids:
            lease = await store.acquire(sid, owner="a", new=True)
            assert lease is not None
            await store.append(lease, Batch(events=(header_event(),)), release=True)
        assert await store.sessions(SID[:33]) == ids  # every one listed, whatever the client forgot
        if isinstance(store, RedisStore):
            assert len(store._listed) <= 2
        else:
            assert isinstance(store, LocalStore) and store.num_remembered == 5
            store.forget(ids[:4])
            assert store.num_remembered == 1
            lease = await store.acquire(ids[0], owner="a")  # a forgotten id that is still there: read again
            assert lease is not None
            await store.append(lease, Batch(events=events_for(["more"])), release=True)
            assert len((await store.read(ids[0])).events) == 2

    with_store(store_url, body)


# -- events: order, replays, gaps -------------------------------------------------------------------------

def test_events_read_back_in_order_and_a_replayed_batch_writes_nothing_twice(store_url: str) -> None:
    async def body(store: Store) -> None:
        lease = await store.acquire(SID, owner="a")
        assert lease is not None
        await store.append(lease, Batch(events=(header_event(),)))
        for k in range(20):  # one batch per request, as the proxy commits them
            await store.append(lease, Batch(events=events_for([f"m{2 * k}", f"m{2 * k + 1}"], 1 + 2 * k, 2 * k)))
        again = Batch(events=events_for(["m38", "m39", "m40"], 39, 38))  # two stored already, one new
        await store.append(lease, again)
        stored = await store.read(SID)
        assert [e["seq"] for e in stored.events] == list(range(42))
        assert [e["message"]["content"] for e in stored.events[1:]] == [f"m{k}" for k in range(41)]
        with pytest.raises(ValueError, match="missing"):  # a hole in the log is refused
            await store.append(lease, Batch(events=events_for(["late"], 50, 49)))
        assert (await store.read(SID)).next_seq == 42
        assert await store.exists(SID) and await store.sessions() == [SID]
        for other in ("0123456789abcdef0123456789abcdef/0001", "0123456789abcdef0123456789abcdeg/0000", "z/0"):
            lease2 = await store.acquire(other, owner="a")
            assert lease2 is not None
            await store.append(lease2, Batch(events=(header_event(),)))
        assert await store.sessions(SID.split("/")[0] + "/") == [SID, "0123456789abcdef0123456789abcdef/0001"]
        assert len(await store.sessions()) == 4 and await store.sessions("z") == ["z/0"]
        assert not await store.exists("other/0000") and (await store.read("other/0000")).events == []

    with_store(store_url, body)


def test_session_ids_and_blob_names_are_checked(store_url: str) -> None:
    async def body(store: Store) -> None:
        for bad in ("../x", "a/../b", "", "a b", "a/b/c/d/e/f"):
            with pytest.raises(ValueError, match="session id"):
                await store.acquire(bad, owner="a")
        with pytest.raises(ValueError, match="blob name"):
            await store.put_blob(SID, "../../etc/passwd", b"x")

    with_store(store_url, body)


# -- the lease and its fencing token ----------------------------------------------------------------------

def test_a_stalled_holder_is_fenced_out_after_another_took_over(store_url: str) -> None:
    async def body(store: Store) -> None:
        old = await store.acquire(SID, owner="replica-1", ttl_ms=150)
        assert old is not None
        assert await store.acquire(SID, owner="replica-2", ttl_ms=150) is None  # held
        await store.append(old, Batch(events=(header_event(),)))
        assert await store.renew(old)
        # The old holder stalls (a GC pause, SIGSTOP) past its lease: it still holds its token.
        await asyncio.sleep(0.3)
        new = await store.acquire(SID, owner="replica-2", ttl_ms=5_000)
        assert new is not None and new.token > old.token
        await store.append(new, Batch(events=events_for(["from the new holder"])))
        # The old holder wakes up and writes what it was doing: refused, nothing of it stored.
        with pytest.raises(LeaseLost, match="another writer"):
            await store.append(old, Batch(events=events_for(["stale"], 2, 1)))
        with pytest.raises(LeaseLost):
            await store.checkpoint(old)
        assert not await store.renew(old)
        await store.release(old)  # not its lease any more: a no-op
        assert await store.acquire(SID, owner="replica-3") is None
        stored = await store.read(SID)
        assert [e.get("message", {}).get("content") for e in stored.events] == [None, "from the new holder"]
        await store.release(new)
        third = await store.acquire(SID, owner="replica-3")
        assert third is not None and third.token > new.token

    with_store(store_url, body)


def test_an_expired_lease_nobody_took_over_may_still_write(store_url: str) -> None:
    """The fence only refuses a holder once a later token exists: alone, a slow holder loses nothing."""
    async def body(store: Store) -> None:
        lease = await store.acquire(SID, owner="a", ttl_ms=50)
        assert lease is not None
        await asyncio.sleep(0.12)
        await store.append(lease, Batch(events=(header_event(),)))
        assert (await store.read(SID)).next_seq == 1

    with_store(store_url, body)


def test_the_fence_holds_across_clients(redis_server: RedisServer) -> None:
    """Two store clients, as two replicas hold them: the fence lives in Redis, not in either."""
    async def body() -> None:
        a, b = RedisStore(redis_server.url), RedisStore(redis_server.url)
        try:
            old = await a.acquire(SID, owner="a", ttl_ms=100)
            assert old is not None
            await a.append(old, Batch(events=(header_event(),)))
            await asyncio.sleep(0.2)
            new = await b.acquire(SID, owner="b")
            assert new is not None
            with pytest.raises(LeaseLost):
                await a.append(old, Batch(events=events_for(["stale"])))
            await b.append(new, Batch(events=events_for(["fresh"])))
            assert [e["type"] for e in (await a.read(SID)).events] == ["header", "append"]
        finally:
            await a.close()
            await b.close()

    run(body())


# -- a real compactor writing through the buffer ----------------------------------------------------------

SYSTEM = "You are a coding agent working in a repository. Use the tools; read before you edit."
TOOLS = (ToolSpec("read", "read lines of a file", {"type": "object", "properties": {"path": {"type": "string"}}}),)


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return load_counter("deepseek-v4")


def readme_lines(start: int, count: int) -> str:
    return "\n".join(f"{n:4d}  The ds4 engine keeps section {n} of the README about KV cache pages and prefill."
                     for n in range(start, start + count))


def drive(c: Compactor, commit: Callable[[], None]) -> None:
    """A conversation that compacts twice (hard trigger: a tool result that does not fit), committing
    after each step as the proxy commits after each request."""
    ids = iter(range(1000))
    for start in (1, 501, 1001):
        c.append(Message(Role.USER, f"Read README.md lines {start}-{start + 499}.", id=f"u{next(ids)}"))
        c.before_request()
        commit()
        cid = f"call_{next(ids)}"
        tool_call = Message(Role.ASSISTANT, "", id=cid + "-m",
                            tool_calls=(ToolCall(cid, "read", json.dumps({"path": "README.md"})),))
        c.append(tool_call)
        c.append_tool_result(Message(Role.TOOL, readme_lines(start, 500)[:25000], id=cid + "-r", tool_call_id=cid,
                                     name="read"))
        commit()
        c.append(Message(Role.ASSISTANT, f"Lines {start}-{start + 499} are about KV pages.", id=f"a{next(ids)}"))
        commit()


def make_compactor(counter: TokenCounter, conv: Conversation, **where: Any) -> Compactor:
    config = CompactConfig.preset("ds4", context_tokens=12000, max_output_tokens=1024)
    return Compactor(conv, config=config, counter=counter, template=get_template("deepseek-v4"), durable=False,
                     **where)


def test_a_compactor_writes_the_same_records_to_redis_as_to_its_session_dir(
        counter: TokenCounter, redis_server: RedisServer, tmp_path: Path) -> None:
    """The compactor's log through a BufferedLog, committed to Redis once per step, is record for record
    the log it writes to a session directory; restore from either is the original conversation, and a
    compactor resumed from Redis has the same view as one resumed from the directory."""
    conv = Conversation([], id="t", system=SYSTEM, tools=TOOLS)
    local = make_compactor(counter, conv, session_dir=tmp_path / "local")
    drive(local, lambda: None)
    local.close()
    assert sum(1 for e in local.events if e.applied) >= 2

    async def body() -> None:
        store = RedisStore(redis_server.url)
        loop = asyncio.get_running_loop()
        lease = await store.acquire(SID, owner="a")
        assert lease is not None
        log = BufferedLog(SID)
        remote = make_compactor(counter, conv, session_log=log)

        def commit() -> None:  # the compactor runs in a worker thread; the commit on the loop
            asyncio.run_coroutine_threadsafe(store.append(lease, log.take()), loop).result()

        await asyncio.to_thread(drive, remote, commit)
        assert log.num_pending == 0
        assert [e.summary for e in remote.events] == [e.summary for e in local.events]

        stored = await store.read(SID)
        records = [r.event for r in Session(tmp_path / "local").read_records()[0]]
        assert stored.events == records
        for folder in ("history", "archive"):  # dumps, and the archive the compactor wrote through the buffer
            names = sorted(os.listdir(tmp_path / "local" / folder))
            assert names
            for name in names:
                assert await store.get_blob(SID, f"{folder}/{name}") == (tmp_path / "local" / folder / name).read_bytes()

        # Resume from the store: a new compactor over the stored records.
        resumed = make_compactor(counter, Conversation([]), session_log=BufferedLog(SID, stored))
        from_dir = make_compactor(counter, Conversation([]), session_dir=tmp_path / "local")
        assert resumed.view == from_dir.view and resumed.originals == from_dir.originals
        assert resumed.view_origins == from_dir.view_origins and resumed._state() == from_dir._state()

        # A checkpoint folds the log and trims the stream; what loads is unchanged.
        through = await store.checkpoint(lease)
        assert through == stored.next_seq - 1
        assert await store.client.xlen(f"ctxfold:{{{SID}}}:ev") == 0
        after = await store.read(SID)
        assert after.checkpoint_seq == through and len(after.events) < len(stored.events)
        a, b = load_events(after.events, source="x"), load_events(stored.events, source="x")
        assert (a.conversation, a.originals, a.view_origins, a.state) == (b.conversation, b.originals,
                                                                         b.view_origins, b.state)
        assert a.num_compactions == b.num_compactions >= 2
        # Events after the checkpoint go on from its seq, and read back after the fold.
        more = Message(Role.USER, "one more question", id="late")
        resumed.journal = log2 = BufferedLog(SID, after)
        log2.load()
        resumed.append(more)
        await store.append(lease, log2.take())
        final = await store.read(SID)
        assert [e["seq"] for e in final.events] == sorted(e["seq"] for e in final.events)
        assert load_events(final.events, source="x").originals[-1] == more
        await store.close()

    run(body())
    restored = restore_from_store(redis_server.url, SID)
    assert restored.messages[:-1] == Session(tmp_path / "local").restore().messages
    assert restored.system == SYSTEM and restored.tools == TOOLS
    with pytest.raises(NoSuchSession):
        restore_from_store(redis_server.url, "nobody/0000")

    # ctxfold restore --store: the same conversation as from the session directory, in the same shape.
    from ctxfold.cli import main

    assert main(["restore", str(tmp_path / "local"), "-o", str(tmp_path / "from-dir.json")]) == 0
    assert main(["restore", "--store", redis_server.url, SID, "-o", str(tmp_path / "from-redis.json")]) == 0
    from_dir = json.loads((tmp_path / "from-dir.json").read_text())
    from_redis = json.loads((tmp_path / "from-redis.json").read_text())
    assert from_redis["messages"][:-1] == from_dir["messages"] and len(from_dir["messages"]) > 10


def test_restore_from_a_store_without_the_session_is_one_line(redis_server: RedisServer, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from ctxfold.cli import main

    assert main(["restore", "--store", redis_server.url, "nobody/0000", "-o", str(tmp_path / "x.json")]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no session 'nobody/0000'" in err and "Traceback" not in err


def test_the_local_store_reads_and_writes_todays_session_files(counter: TokenCounter, tmp_path: Path) -> None:
    conv = Conversation([], id="t", system=SYSTEM, tools=TOOLS)
    c = make_compactor(counter, conv, session_dir=tmp_path / "sessions" / SID)
    drive(c, lambda: None)
    c.close()
    expected = Session(tmp_path / "sessions" / SID).load()

    async def body(store: Store) -> None:
        assert await store.sessions() == [SID]
        stored = await store.read(SID)
        got = load_events(stored.events, source="x")
        assert (got.conversation, got.originals, got.view_origins, got.state) == (
            expected.conversation, expected.originals, expected.view_origins, expected.state)
        lease = await store.acquire(SID, owner="a")
        assert lease is not None
        await store.append(lease, Batch(events=(append_event(stored.next_seq, len(got.originals), "appended"),)))
        # A checkpoint rewrites the file as its fold: still today's format.
        await store.checkpoint(lease)

    with_store(str(tmp_path / "sessions"), body)
    again = Session(tmp_path / "sessions" / SID).load()
    assert again.originals[:-1] == expected.originals and again.originals[-1].text == "appended"
    assert again.conversation.messages[:-1] == expected.conversation.messages
    records, _ = Session(tmp_path / "sessions" / SID).read_records()
    assert fold_events([r.event for r in records if r.event]) == [
        r.event for r in records if r.event]  # a fold of a fold: itself


def test_a_stored_archive_is_read_in_a_worker_thread_from_what_the_loop_fetched(store_url: str) -> None:
    """A recall call reads the archive in a worker thread; the store is read on the event loop before
    it (the worker never waits on the loop). Fetched: read. Absent from the store: no such id. The
    store failing: the reader says it could not read, not that the id is unknown. Listed: searchable."""
    stored_text, other_text = "an archived output " * 20, "written by another replica " * 10
    failing = False

    async def body(store: Store) -> None:
        aid, other = content_id(stored_text), content_id(other_text)
        await store.put_blob(SID, f"archive/{aid}.txt", stored_text.encode())

        async def fetch(name: str) -> bytes:
            if failing:
                raise OSError(5, "the store is unreachable")
            return await store.get_blob(SID, name)

        async def names() -> list[str]:
            return await store.blob_names(SID)

        archive = ArchiveStore(BufferedLog(SID, fetch=fetch, list_blobs=names).archive_backend())
        backend = archive.backend
        assert isinstance(backend, BufferedArchive)
        with pytest.raises(KeyError):  # nothing fetched yet: the worker does not reach for the store
            await asyncio.to_thread(archive.get, aid)
        await backend.fetch([f"{aid}.txt", f"{'0' * 64}.txt"])
        assert await asyncio.to_thread(archive.get, aid) == stored_text
        with pytest.raises(KeyError):
            await asyncio.to_thread(archive.get, "0" * 64)
        nonlocal failing
        failing = True
        await backend.fetch([f"{aid}.txt"])
        with pytest.raises(ArchiveError, match="unreachable"):
            await asyncio.to_thread(archive.get, aid)
        failing = False
        await store.put_blob(SID, f"archive/{other}.txt", other_text.encode())
        assert archive.ids() == [aid]  # the one fetched: the other is listed once the loop asks the store
        assert await backend.relist() == sorted([f"{aid}.txt", f"{other}.txt"])
        assert archive.ids() == sorted([aid, other])

    with_store(store_url, body)


def test_a_read_fetches_the_id_as_the_tool_reads_it(store_url: str) -> None:
    """read_archive forgives an id copied with its 'id=', in capitals or with spaces: the loop fetches
    that same id for the worker, or the read says the id is unknown."""
    text = "an archived output " * 20

    async def body(store: Store) -> None:
        aid = content_id(text)
        await store.put_blob(SID, f"archive/{aid}.txt", text.encode())

        async def fetch(name: str) -> bytes:
            return await store.get_blob(SID, name)

        archive = ArchiveStore(BufferedLog(SID, fetch=fetch).archive_backend())
        for given in (f"id={aid}", f" {aid.upper()} "):
            call = ToolCall(id="c", name=READ_ARCHIVE, arguments=json.dumps({"id": given}))
            await fetch_for(archive, call)
            answer = await asyncio.to_thread(answer_recall_call, archive, call)
            assert not answer.is_error and answer.text.endswith(text), (given, answer.text)

    with_store(store_url, body)


def test_a_search_fetches_every_text_between_turns_of_the_loop_and_skips_the_unreadable(store_url: str) -> None:
    """A conversation's first search reads each archived text the index lacks, on the event loop: other
    conversations' callbacks run between two reads. A text the index left out as unreadable (its bytes
    do not match its id) is not fetched again by the next search, where it would wait in memory for good."""
    texts = [f"archived output number {i} " * 30 for i in range(6)]
    corrupt = "an output whose bytes changed " * 10

    async def body(store: Store) -> None:
        for t in texts:
            await store.put_blob(SID, f"archive/{content_id(t)}.txt", t.encode())
        bad = content_id(corrupt)
        await store.put_blob(SID, f"archive/{bad}.txt", b"not what its id says")
        fetched: list[str] = []

        async def fetch(name: str) -> bytes:
            fetched.append(name)
            return await store.get_blob(SID, name)

        async def names() -> list[str]:
            return await store.blob_names(SID)

        archive = ArchiveStore(BufferedLog(SID, fetch=fetch, list_blobs=names).archive_backend())
        turns = 0
        stop = asyncio.Event()

        async def other_conversation() -> None:
            nonlocal turns
            while not stop.is_set():
                turns += 1
                await asyncio.sleep(0)

        other = asyncio.create_task(other_conversation())
        await asyncio.sleep(0)
        call = ToolCall(id="c", name=SEARCH_ARCHIVE, arguments=json.dumps({"query": "number 3"}))
        before = turns
        await fetch_for(archive, call)
        assert turns - before >= len(texts)  # the loop turned between the reads
        stop.set()
        await other
        answer = await asyncio.to_thread(answer_recall_call, archive, call)
        assert not answer.is_error and "number 3" in answer.text
        assert bad in archive.search_index.unreadable
        fetched.clear()
        await fetch_for(archive, call)
        assert fetched == []  # every text indexed or known to be unreadable: nothing read again

    with_store(store_url, body)


# -- failures: unreachable, spool and replay --------------------------------------------------------------

def test_an_unreachable_store_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens on it once closed

    async def body(store: Store) -> None:
        with pytest.raises(StoreUnavailable, match="unreachable|failed"):
            await store.read(SID)
        with pytest.raises(StoreUnavailable):
            await store.acquire(SID, owner="a")

    with_store(f"redis://127.0.0.1:{port}/0", body)


def test_writes_spool_while_redis_is_down_and_replay_in_order(redis_server: RedisServer, tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"

    async def body() -> None:
        store = SpoolingStore(RedisStore(redis_server.url), spool_dir)
        lease = await store.acquire(SID, owner="a", ttl_ms=60_000)
        assert lease is not None
        await store.append(lease, Batch(events=(header_event(), *events_for(["one"]))))
        redis_server.stop()
        with pytest.raises(Spooled, match="local spool"):
            await store.append(lease, Batch(blobs=(("archive/" + "a" * 64 + ".txt", b"blob"),),
                                            events=events_for(["two"], 2, 1)))
        # While the store is down, later batches of the session queue behind the first one.
        with pytest.raises(Spooled):
            await store.append(lease, Batch(events=events_for(["three", "four"], 3, 2)))
        assert store.num_pending == 2 and len(os.listdir(spool_dir)) == 2
        assert await store.get_blob(SID, "archive/" + "a" * 64 + ".txt") == b"blob"
        assert not await store.replay(force=True)
        await store.close()

        redis_server.start()
        # A new process (the replica restarted meanwhile) finds the spool and replays it.
        store = SpoolingStore(RedisStore(redis_server.url), spool_dir)
        assert store.num_pending == 2
        await store.append(lease, Batch(events=events_for(["five"], 5, 4)))  # replays first, then writes
        assert store.num_pending == 0 and os.listdir(spool_dir) == []
        stored = await store.read(SID)
        assert [e.get("message", {}).get("content") for e in stored.events] == [
            None, "one", "two", "three", "four", "five"]
        assert await store.get_blob(SID, "archive/" + "a" * 64 + ".txt") == b"blob"
        await store.close()

    run(body())


def test_taking_the_lease_again_replays_the_spool_under_the_old_token_first(redis_server: RedisServer,
                                                                          tmp_path: Path) -> None:
    """A replica whose lease ran out while Redis was down takes it again: its spooled writes go first,
    under their old token, which the new grant would otherwise fence out."""
    async def body() -> None:
        store = SpoolingStore(RedisStore(redis_server.url), tmp_path / "spool")
        lease = await store.acquire(SID, owner="a", ttl_ms=100)
        assert lease is not None
        await store.append(lease, Batch(events=(header_event(),)))
        redis_server.stop()
        with pytest.raises(Spooled):
            await store.append(lease, Batch(events=events_for(["while down"])))
        redis_server.start()
        await asyncio.sleep(0.15)
        again = await store.acquire(SID, owner="a", ttl_ms=100)
        assert again is not None and again.token > lease.token and store.num_pending == 0
        await store.append(again, Batch(events=events_for(["after"], 2, 1)))
        assert [e.get("message", {}).get("content") for e in (await store.read(SID)).events] == [
            None, "while down", "after"]
        await store.close()

    run(body())


def test_a_full_spool_keeps_nothing_more_and_says_so(redis_server: RedisServer, tmp_path: Path) -> None:
    async def body() -> None:
        store = SpoolingStore(RedisStore(redis_server.url), tmp_path / "spool", max_bytes=600)
        lease = await store.acquire(SID, owner="a")
        assert lease is not None
        redis_server.stop()
        with pytest.raises(Spooled):
            await store.append(lease, Batch(events=(header_event(),)))
        with pytest.raises(SpoolFull, match="full"):
            await store.append(lease, Batch(events=events_for(["x" * 1000])))
        assert store.num_pending == 1 and store.nbytes <= 600
        await store.close()

    run(body())


def test_a_spooled_batch_fenced_out_on_replay_is_kept_aside(redis_server: RedisServer, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        store = SpoolingStore(RedisStore(redis_server.url), tmp_path / "spool")
        lease = await store.acquire(SID, owner="a", ttl_ms=100)
        assert lease is not None
        await store.append(lease, Batch(events=(header_event(),)))
        redis_server.stop()
        with pytest.raises(Spooled):
            await store.append(lease, Batch(events=events_for(["stale"])))
        redis_server.start()
        await asyncio.sleep(0.15)
        other = RedisStore(redis_server.url)
        new = await other.acquire(SID, owner="b")
        assert new is not None
        await other.append(new, Batch(events=events_for(["fresh"])))
        with caplog.at_level(logging.WARNING, logger="ctxfold.compaction.store"):
            assert await store.replay(force=True)
        assert "refused by the store" in caplog.text
        assert [n.endswith(".refused") for n in os.listdir(tmp_path / "spool")] == [True]
        # Surfaced (counted for the metrics and /health), and no longer part of the pending bound.
        assert store.num_refused == 1 and store.nbytes == 0 and store.refused_nbytes > 0
        assert [e.get("message", {}).get("content") for e in (await other.read(SID)).events] == [None, "fresh"]
        await store.close()
        await other.close()

    run(body())


# -- durability -------------------------------------------------------------------------------------------

def test_nothing_acknowledged_is_lost_when_redis_is_killed(redis_server: RedisServer) -> None:
    """appendfsync always: every append the store acknowledged is on disk; SIGKILL, restart, read back."""
    n = 200

    async def write() -> None:
        store = RedisStore(redis_server.url)
        lease = await store.acquire(SID, owner="a")
        assert lease is not None
        await store.append(lease, Batch(events=(header_event(),)))
        for k in range(n):
            await store.append(lease, Batch(blobs=((f"history/{k:06d}-{k:016x}.jsonl", f"dump {k}".encode()),),
                                            events=events_for([f"m{k}"], 1 + k, k)))
        await store.checkpoint(lease)  # a checkpoint and trim are in the AOF too
        await store.append(lease, Batch(events=events_for(["after"], n + 1, n)))
        await store.client.aclose()  # no QUIT, no SHUTDOWN: the server is killed next

    run(write())
    redis_server.kill()
    redis_server.start()

    async def read() -> None:
        store = RedisStore(redis_server.url)
        stored = await store.read(SID)
        assert [e.get("message", {}).get("content") for e in stored.events] == [None, *(f"m{k}" for k in range(n)),
                                                                                "after"]
        assert await store.get_blob(SID, f"history/{n - 1:06d}-{n - 1:016x}.jsonl") == f"dump {n - 1}".encode()
        assert store.durability_warning is None
        await store.close()

    run(read())


def test_weak_persistence_is_warned_about_once(redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    redis_server.stop()
    redis_server.start("--appendfsync", "everysec")

    async def body(url: str) -> str | None:
        store = RedisStore(url)
        with caplog.at_level(logging.WARNING, logger="ctxfold.compaction.store"):
            await store.exists(SID)
            await store.exists(SID)
        await store.close()
        return store.durability_warning

    warning = run(body(redis_server.url))
    assert warning is not None and "appendfsync everysec" in warning
    assert [r.getMessage() for r in caplog.records] == [warning]
    caplog.clear()
    assert run(body(redis_server.url + "?durability=everysec")) is None and not caplog.records


def test_durability_problem_names_what_to_set() -> None:
    assert durability_problem("u", "yes", "always", "always") is None
    assert durability_problem("u", "yes", "everysec", "everysec") is None
    assert "appendonly no" in (durability_problem("u", "no", "always", "everysec") or "")
    assert "appendfsync no" in (durability_problem("u", "yes", "no", "everysec") or "")


def test_store_urls() -> None:
    assert isinstance(open_store("/tmp/x"), LocalStore) and isinstance(open_store("file:///tmp/x"), LocalStore)
    r = open_store("valkey://user:secret@127.0.0.1:1/0?prefix=p&durability=everysec")
    assert isinstance(r, RedisStore) and r.prefix == "p" and r.durability == "everysec"
    assert "secret" not in r.url
    with pytest.raises(ValueError, match="durability"):
        open_store("redis://127.0.0.1:1/0?durability=sometimes")
    with pytest.raises(ValueError, match="expected a directory"):
        open_store("s3://bucket/x")


STALLED_WRITER = """
import asyncio, sys, time
from pathlib import Path
from ctxfold.compaction.store import Batch, LeaseLost
from ctxfold.compaction.store.redis_store import RedisStore

async def main() -> None:
    store = RedisStore(sys.argv[1])
    lease = await store.acquire(sys.argv[2], owner="stalled", ttl_ms=200)
    await store.append(lease, Batch(events=({"seq": 0, "type": "header", "version": 1, "conversation": {}},)))
    print("holding", lease.token, flush=True)
    while not Path(sys.argv[3]).exists():  # the compaction it is in the middle of
        time.sleep(0.01)
    try:
        await store.append(lease, Batch(events=({"seq": 1, "type": "state", "state": {"stale": True}},)))
        print("written", flush=True)
    except LeaseLost:
        print("refused", flush=True)
    await store.close()

asyncio.run(main())
"""


def test_a_replica_stopped_with_sigstop_is_refused_when_it_resumes(redis_server: RedisServer, tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    from helpers.subprocess_env import ctxfold_env

    flag = tmp_path / "go"
    with subprocess.Popen([sys.executable, "-c", STALLED_WRITER, redis_server.url, SID, str(flag)],
                          stdout=subprocess.PIPE, text=True, env=ctxfold_env()) as proc:
        assert proc.stdout is not None
        old_token = int(proc.stdout.readline().split()[1])
        proc.send_signal(signal.SIGSTOP)
        try:
            async def take_over() -> int:
                store = RedisStore(redis_server.url)
                try:
                    deadline = asyncio.get_running_loop().time() + 10
                    while (lease := await store.acquire(SID, owner="new", ttl_ms=10_000)) is None:
                        assert asyncio.get_running_loop().time() < deadline, "the stopped holder's lease never expired"
                        await asyncio.sleep(0.05)
                    await store.append(lease, Batch(events=(append_event(1, 0, "the new holder's"),)))
                    return lease.token
                finally:
                    await store.close()

            assert run(take_over()) > old_token
            flag.touch()
        finally:
            proc.send_signal(signal.SIGCONT)
        out, _ = proc.communicate(timeout=30)
    assert out.strip() == "refused" and proc.returncode == 0

    async def check(store: Store) -> list[str]:
        return [e["type"] for e in (await store.read(SID)).events]

    assert with_store(redis_server.url, check) == ["header", "append"]


async def _deny_stream_appends(url: str, deny: bool) -> None:
    """A partial outage: the store's user may no longer XADD (an ACL change, as memory full on the stream
    keys would refuse them too), while leases are still granted."""
    import redis.asyncio as aioredis

    admin = aioredis.Redis.from_url(url)
    try:
        await admin.execute_command("ACL", "SETUSER", "default", "-xadd" if deny else "+xadd")
    finally:
        await admin.aclose()


def test_no_new_lease_while_the_session_waits_in_the_spool(redis_server: RedisServer, tmp_path: Path) -> None:
    """Stream appends refused, leases still granted: the spooled answers of a conversation must reach the
    store before anyone (this process first) is granted the session again. A lease granted before the
    replay fences the spooled batches out, and answers the client already has are lost."""
    async def body() -> None:
        store = SpoolingStore(RedisStore(redis_server.url), tmp_path / "spool")
        lease = await store.acquire(SID, owner="a")
        assert lease is not None
        await store.append(lease, Batch(events=(header_event(), *events_for(["one"]))))
        await _deny_stream_appends(redis_server.url, True)
        with pytest.raises(Spooled):
            await store.append(lease, Batch(events=events_for(["answered while refused"], 2, 1)), release=True)
        await store.release(lease)
        # The next request of the conversation: no lease while its batch waits (it passes through).
        with pytest.raises(StoreUnavailable, match="spool"):
            await store.acquire(SID, owner="a")
        assert store.num_pending == 1
        await _deny_stream_appends(redis_server.url, False)
        again = await store.acquire(SID, owner="a")
        assert again is not None and store.num_pending == 0 and store.num_refused == 0
        await store.append(again, Batch(events=events_for(["after"], 3, 2)))
        assert [e.get("message", {}).get("content") for e in (await store.read(SID)).events] == [
            None, "one", "answered while refused", "after"]
        assert os.listdir(tmp_path / "spool") == []
        await store.close()

    run(body())


def test_refused_batches_are_kept_up_to_their_own_bound(redis_server: RedisServer, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Batch after batch refused on replay: the oldest refused files go, and new writes still spool."""
    async def body() -> None:
        store = SpoolingStore(RedisStore(redis_server.url), tmp_path / "spool", max_bytes=1500)
        other = RedisStore(redis_server.url)
        for k in range(4):
            sid = f"{SID[:-4]}{k:04d}"
            lease = await store.acquire(sid, owner="a", ttl_ms=100)
            assert lease is not None
            await store.append(lease, Batch(events=(header_event(),)))
            await _deny_stream_appends(redis_server.url, True)
            with pytest.raises(Spooled):
                await store.append(lease, Batch(events=events_for(["stale " + "x" * 300])))
            await _deny_stream_appends(redis_server.url, False)
            await asyncio.sleep(0.15)
            taken = await other.acquire(sid, owner="b")  # another replica takes the session over
            assert taken is not None
            with caplog.at_level(logging.WARNING, logger="ctxfold.compaction.store"):
                assert await store.replay(force=True)
        assert store.num_refused == 4 and store.num_pending == 0
        assert 0 < store.refused_nbytes <= 1500 and "refused batches are kept up to" in caplog.text
        assert len(os.listdir(tmp_path / "spool")) < 4
        await store.close()
        await other.close()

    run(body())


def test_a_corrupt_spool_file_is_set_aside_and_named_and_the_rest_replays(
        redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spool_dir = tmp_path / "spool"

    async def body() -> None:
        store = SpoolingStore(RedisStore(redis_server.url), spool_dir)
        lease = await store.acquire(SID, owner="a", ttl_ms=60_000)
        assert lease is not None
        await store.append(lease, Batch(events=(header_event(),)))
        redis_server.stop()
        for k, text in enumerate(["one", "two"]):
            with pytest.raises(Spooled):
                await store.append(lease, Batch(events=events_for([text], 1 + k, k)))
        await store.close()
        _, second = sorted(spool_dir.iterdir())
        second.write_bytes(second.read_bytes()[:40])  # cut short, as a full disk would leave it
        redis_server.start()
        with caplog.at_level(logging.WARNING, logger="ctxfold.compaction.store"):
            store = SpoolingStore(RedisStore(redis_server.url), spool_dir)
        assert store.set_aside == [second.with_suffix(".corrupt")] and second.name in caplog.text
        assert store.num_pending == 1 and await store.replay(force=True)
        assert [e.get("message", {}).get("content") for e in (await store.read(SID)).events] == [None, "one"]
        await store.close()

    run(body())
