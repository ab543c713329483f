"""`JetStreamState`: the coordinator's durable state in two JetStream KV buckets (async shell).

The layout is `coordinator.state.records`'s, the ownership rules `coordinator.state.ownership`'s;
this module only moves bytes. Every write is acknowledged by JetStream before the coordinator
acknowledges what it records (a registration, a measured window), so nothing acknowledged is
lost when a coordinator dies; with `replicas` > 1 on a NATS cluster, nothing is lost when a
server dies either. A power loss of a server loses nothing acknowledged only if it synced each
write before acknowledging it (`sync_interval: always`, as every server this project starts or
ships a configuration for does; nats-server's default flushes every 2 minutes). Every replica
follows both buckets (KV watches) and keeps its in-memory view in step: a rank registered
through one replica is known to all.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.errors import NoRespondersError
from nats.js.errors import (
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    ServiceUnavailableError,
)

from coordinator.jobs import DuplicateError, JobRecord, RankRecord, RegistryError
from coordinator.state import records
from coordinator.state.buckets import bind_buckets, bucket_keys
from coordinator.state.group_commit import REFUSED, GroupCommit, Outcome, answer_ack
from coordinator.state.watch import follow as follow_bucket
from zeus_agent.history import History

LOG = logging.getLogger(__name__)

Entry = Any
"""A `nats.js.kv.KeyValue.Entry`."""

OnEntry = Callable[[Entry], Awaitable[None]]

_CREATE_HEADERS = {"Nats-Expected-Last-Subject-Sequence": "0"}
"""A KV create: the key's subject has no message yet (nats-py's `KeyValue.create`)."""
_BEING_WRITTEN = "wrong last sequence (another write of the key is being replicated)"


def _expire(future: asyncio.Future[bytes]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


CREATED, IN_FLIGHT, EXISTS, OTHER = "created", "in_flight", "exists", "other"
"""What a create's acknowledgement says (`create_outcome`)."""
MAX_OWN_ENTRIES = 65_536
"""Node entries a replica remembers writing until their echo (`JetStreamState.own_entries`)."""


def _holds(key: str, raw: bytes, rank: RankRecord) -> bool:
    """Whether the node entry `key` (its value `raw`) records `rank` as it is."""
    change = records.decode(key, raw, False, 0)
    return any(one.rank == rank for one in change.ranks)


WRONG_LAST_SEQUENCE = 10071
"""JetStream's error code: the subject's last message is another one (its sequence given)."""
IN_PROCESS = 10164
"""JetStream's error code "wrong last sequence" without a sequence: on a clustered stream, the
leader refuses a write that expects a subject's last sequence while another such write of that
subject is still being replicated (proposed, not yet stored)."""


def create_outcome(ack: bytes) -> str:
    """What a publish acknowledgement says of a create ("expected last subject sequence 0").

    `CREATED`: stored. `IN_FLIGHT`: another writer's write of the key is being replicated and is
    not readable yet (code 10164): nats-py's `create` then looks the key up, finds nothing and
    raises `KeyNotFoundError`, which is how concurrent creates of one key failed on a NATS
    cluster. `EXISTS`: the key has a message (a value, or a delete or purge marker: code 10071).
    `OTHER`: anything else (no responders, another error). The bytes are looked at first (a
    JSON parse per create was a tenth of the create's cost), then parsed when unusual. An
    error's acknowledgement also carries `"seq":0`, so the error is looked for first.
    """
    if b'"error"' not in ack:
        if ack.startswith(b'{"stream":') and b'"seq":' in ack:
            return CREATED
        try:
            return CREATED if "seq" in json.loads(ack) else OTHER
        except (ValueError, TypeError):
            return OTHER
    try:
        code = json.loads(ack)["error"].get("err_code")
    except (ValueError, TypeError, KeyError, AttributeError):
        return OTHER
    return {IN_PROCESS: IN_FLIGHT, WRONG_LAST_SEQUENCE: EXISTS}.get(code, OTHER)


class StateUnavailableError(RegistryError):
    """JetStream did not take a write: the change was not made."""

    code = "unavailable"


class JetStreamState:
    """The state and ownership buckets of one subject prefix."""

    def __init__(self, nc: Any, prefix: str, replicas: int = 1, timeout_s: float = 5.0,
                 bucket: str | None = None, retry_s: float = 10.0,
                 history: History | None = None) -> None:
        self.nc = nc
        self.retry_s = retry_s
        """How long a write is retried while JetStream cannot answer (a leader election)."""
        self.js = nc.jetstream(timeout=timeout_s)
        self.bucket, self.owners_bucket = ((bucket, f"{bucket}-owners") if bucket
                                           else records.bucket_names(prefix))
        self.replicas = replicas
        self.timeout_s = timeout_s
        self.kv: Any = None
        self.owners: Any = None
        self._watchers: list[Any] = []
        """The watches' consumer subscriptions (`watch.follow`)."""
        # Creates acknowledged on one wildcard inbox (see `_create`).
        self._acks: dict[int, asyncio.Future[bytes]] = {}
        self._ack_inbox = ""
        self._ack_sub: Any = None
        self._ack_ids = itertools.count()
        self.batches: GroupCommit | None = None
        """Registrations' creates in atomic batches (`group_commit`), once the buckets are open."""
        self.own_entries: dict[str, tuple[str, list[RankRecord]]] = {}
        """Node entries this replica is writing or wrote, by key: (job id, its ranks). Their
        ranks are known here: the watch's echo need not be decoded (`DurableState.apply`)."""
        self.history = history
        """Where acknowledged writes and leases taken are recorded (`--history`), if anywhere."""

    def _log(self, kind: str, **fields: Any) -> None:
        if self.history is not None:
            self.history.record(kind, bucket=self.bucket, **fields)

    async def open(self) -> None:
        """Bind the buckets, creating them on first use (`buckets.bind_buckets`).

        Raises:
            NoJetStreamError: The server has no JetStream, or refused the buckets.
        """
        self.kv, self.owners = await bind_buckets(
            self.js, [self.bucket, self.owners_bucket], self.replicas, self.retry_s)
        self.batches = GroupCommit(self.nc, self.bucket, self.timeout_s)
        await self.batches.enable(self.timeout_s)

    async def follow(self, on_state: OnEntry, on_owner: OnEntry) -> None:
        """Feed every entry of both buckets, current ones first, then changes as they come.

        Returns once the current entries have all been fed (the view is complete).
        """
        for bucket, keys, callback in ((self.bucket, records.FOLLOWED, on_state),
                                       (self.owners_bucket, ">", on_owner)):
            self._watchers.append(await follow_bucket(self.js, bucket, keys, callback))

    async def watch(self, keys: str, callback: OnEntry) -> None:
        """Feed the state bucket's entries under `keys` to `callback`, for as long as it is open.

        Current entries first, then changes; returns once the current ones were fed. One
        long-lived watch: asking again every round would create a JetStream consumer each
        time, which on a cluster whose leader is being elected only adds to the queue.
        """
        self._watchers.append(await follow_bucket(self.js, self.bucket, keys, callback))

    async def close(self) -> None:
        """Stop following the buckets."""
        for sub in self._watchers:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._watchers.clear()
        if self.batches is not None:
            await self.batches.close()
        if self._ack_sub is not None:
            with contextlib.suppress(Exception):
                await self._ack_sub.unsubscribe()
            self._ack_sub = None

    async def _create(self, key: str, value: bytes) -> None:
        """`kv.create(key, value)`, with the common case (a new key, taken) made cheap.

        Registrations make their creates in atomic batches (`group_commit`); this is each
        create on its own (a job's, a refused batch's keys). When every rank made two, nats-py's
        create (key check, request with its own inbox token, `PubAck` object) cost a third of
        a replica's CPU. Here the create is one publish with the "expected last subject sequence
        0" header, its acknowledgement routed from one wildcard inbox to a future (a timer,
        not `asyncio.wait_for`, bounds the wait: no task per create).

        Raises:
            KeyWrongLastSequenceError: The key is taken: it holds a value, or another writer's
                create of it is still being replicated (`IN_FLIGHT`; nats-py's `create` raised
                `KeyNotFoundError` there). A key whose last message is a delete or purge
                marker is created over it (an update expecting the marker's revision).
        """
        if self._ack_sub is None:
            self._ack_inbox = self.nc.new_inbox()
            self._ack_sub = await self.nc.subscribe(f"{self._ack_inbox}.*", cb=self._on_ack)
        n = next(self._ack_ids)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bytes] = loop.create_future()
        self._acks[n] = future
        timer = loop.call_later(self.timeout_s, _expire, future)
        try:
            await self.nc.publish(f"$KV.{self.bucket}.{key}", value,
                                  reply=f"{self._ack_inbox}.{n}", headers=_CREATE_HEADERS)
            ack = await future
        finally:
            timer.cancel()
            self._acks.pop(n, None)
        outcome = create_outcome(ack)
        if outcome == CREATED:
            return
        if outcome == IN_FLIGHT:
            raise KeyWrongLastSequenceError(description=_BEING_WRITTEN)
        if outcome == OTHER:  # No responders, another error: nats-py raises what it raises.
            try:
                await self.kv.update(key, value, last=0)
                return
            except KeyWrongLastSequenceError:
                pass
        await self._create_over_marker(key, value)

    async def _create_over_marker(self, key: str, value: bytes) -> None:
        """Create a key that has a message: only over a delete or purge marker."""
        from nats.js.errors import KeyNotFoundError

        try:
            await self.kv.get(key)
        except KeyNotFoundError as e:
            if e.entry is None:  # Nothing stored: another writer's create is still in flight.
                raise KeyWrongLastSequenceError(description=_BEING_WRITTEN) from None
            await self.kv.update(key, value, last=e.entry.revision)  # Over the marker.
            return
        raise KeyWrongLastSequenceError(description="wrong last sequence (the key has a value)")

    async def _on_ack(self, msg: Any) -> None:
        answer_ack(self._acks, msg)

    # ------------------------------------------------------------------ writes
    async def _write(self, what: str, call: Callable[[], Awaitable[Any]],
                     since: float | None = None) -> Any:
        """Run a bucket operation, retrying while JetStream cannot answer for a moment.

        A stream whose leader died answers nothing until the cluster elects another (about
        4 s measured on a 3-server cluster): `call` is retried with backoff for `retry_s`
        (from `since`, the loop's time of a first try made elsewhere, if given).

        Raises:
            StateUnavailableError: It failed, other than by a lost compare-and-set.
        """
        loop = asyncio.get_running_loop()
        deadline = (loop.time() if since is None else since) + self.retry_s
        pause = 0.05
        while True:
            try:
                return await call()
            except (RegistryError, KeyWrongLastSequenceError):
                raise
            except (NoStreamResponseError, ServiceUnavailableError, NoRespondersError,
                    TimeoutError) as e:
                if loop.time() + pause < deadline:
                    LOG.debug("JetStream busy on %s (%s); retrying", what, type(e).__name__)
                    await asyncio.sleep(pause)
                    pause = min(1.0, pause * 2)
                    continue
                error: Exception = e
            except Exception as e:  # noqa: BLE001 - API errors
                error = e
            raise StateUnavailableError(
                f"the coordinator could not record {what} in JetStream ({type(error).__name__}: "
                f"{error}); nothing was registered: retry in a moment"
            ) from None

    async def create_job(self, record: JobRecord) -> bool:
        """Record a new job; False if its id is taken (the caller picks another).

        Taken: recorded, or being recorded by another replica right now (its write not yet
        readable), which the caller cannot tell apart and need not: either way the id is not
        this job's.

        Raises:
            StateUnavailableError: JetStream did not take it.
        """
        try:
            await self._write(f"job {record.job_id}",
                              lambda: self._create(records.job_key(record.job_id),
                                                   records.encode_job(record)))
        except KeyWrongLastSequenceError:
            return False
        self._log("ack", key=records.job_key(record.job_id), job_id=record.job_id)
        return True

    async def create_rank(self, job_id: str, rank: RankRecord,
                          limits: tuple[int, int] | None = None,
                          energy_period_ms: float | None = None, batch: bool = True,
                          node_ranks: bool = False, landed: str | None = None) -> bool:
        """Record a rank and its GPU binding, each exactly once across replicas.

        Both keys go together in one atomic batch with other ranks' (`group_commit`: one
        synced write and one acknowledgement for many ranks). Where that does not work (no
        batches, or the batch refused), the GPU's key is taken first: a rank's key (what
        replicas follow) only ever appears for a GPU it holds alone, so no replica's view sees
        two ranks on one GPU. A batch not answered in time that landed after all is this
        rank's: found holding the batch's id (or `landed`'s, a node batch's), it is reported
        new, not a retry. `batch` False: one by one at once (a retry the caller knows: its
        taken keys would refuse the batch of every other rank in it). `node_ranks`: the job's
        ranks are in node entries (`JobRecord.node_ranks`): the rank's `rank.` key, then a
        node entry of it alone (`v.ranks.<h>.<rank>`, unless that key holds it already: a
        retry of a rank whose node entry began at another rank writes it again, the same
        rank read the same, which also mends a `rank.` key left without its entry; not a
        retry the caller knows, `batch` False: its replica follows the rank's entry already).

        Returns:
            True if new, False if the same rank was already recorded identically (a retry).

        Raises:
            DuplicateError: The rank, or its GPU, is recorded differently.
            StateUnavailableError: JetStream did not take it.
        """
        info, gpu = rank.info, rank.gpu
        gpu_key = records.gpu_key(job_id, gpu.node, gpu.gpu_index)
        gpu_value = records.encode_gpu(job_id, info.rank)
        key = (records.rank_claim_key if node_ranks else records.rank_key)(job_id, info.rank)
        value = records.encode_rank(job_id, rank, limits, energy_period_ms)
        unit = [(gpu_key, gpu_value), (key, value)]
        if node_ranks:
            unit.append((records.node_key(job_id, info.rank),
                         records.encode_node(job_id, [value])))
        outcome = REFUSED
        if self.batches is not None and batch:
            outcome = await self.batches.create(unit)
        if outcome.committed:
            # All at once, in one atomic batch with other ranks' (`group_commit`): durable.
            for written, _ in unit:
                self._log("ack", key=written, job_id=job_id)
            return True
        loop = asyncio.get_running_loop()
        started = loop.time()
        # Not batched, or its batch refused (a key taken, here or by another rank of it): each
        # key on its own, which tells a retry from a conflict.
        new_gpu = await self._create_new(gpu_key, gpu_value) or await self._create_once(
            gpu_key, gpu_value, lambda raw: records.rank_of_gpu_value(raw) == info.rank,
            f"GPU {gpu.gpu_index} on {gpu.node} already drives another rank of job "
            f"{job_id}; give each rank its own GPU", started)
        new = False
        try:
            started = loop.time()
            new = await self._create_new(key, value) or await self._create_once(
                key, value, lambda raw: records.decode(key, raw, False, 0).rank == rank,
                f"rank {info.rank} of job {job_id} is already registered with another GPU or "
                "coordinates; each rank registers once", started)
            if node_ranks and (new or batch):  # (A retry the caller knows: its rank is in
                # an entry it follows, and one of its own would only add to every replica's.)
                await self._create_once(*unit[2], lambda raw: _holds(unit[2][0], raw, rank),
                                        f"the node entry of rank {info.rank} of job {job_id} "
                                        "holds another rank")
            for written, _ in unit:
                self._log("ack", key=written, job_id=job_id)
            batch_id = outcome.batch_id or landed
            if not new and batch_id is not None:
                return await self._written_by(key, batch_id)
            return new
        except RegistryError:
            # Undo: the GPU must not stay bound to a rank that is not recorded.
            for created, undo in ((new_gpu, gpu_key), (new and node_ranks, key)):
                if created:
                    with contextlib.suppress(Exception):
                        await self.kv.delete(undo)
            raise

    async def create_node_ranks(self, job_id: str, ranks: list[tuple[
            RankRecord, tuple[int, int] | None, float | None]]) -> Outcome:
        """Record ranks of a job together: one node entry, a `rank.` and a `gpu.` key each.

        `ranks`: (rank, its GPU's limit range, its energy-counter period) in rank order. All
        in one atomic batch (`group_commit`), or nothing: not committed, each rank is then
        recorded on its own (`create_rank` with `node_ranks`, `landed` the outcome's
        `batch_id`), which tells retries from conflicts.
        """
        if self.batches is None or not ranks:
            return REFUSED
        unit: list[tuple[str, bytes]] = []
        values = []
        for rank, limits, period in ranks:
            info, gpu = rank.info, rank.gpu
            value = records.encode_rank(job_id, rank, limits, period)
            values.append(value)
            unit += [(records.gpu_key(job_id, gpu.node, gpu.gpu_index),
                      records.encode_gpu(job_id, info.rank)),
                     (records.rank_claim_key(job_id, info.rank), value)]
        entry = records.node_key(job_id, ranks[0][0].info.rank)
        unit.append((entry, records.encode_node(job_id, values)))
        own = self.own_entries
        if len(own) >= MAX_OWN_ENTRIES:
            own.clear()  # (Entries whose echo never came: their jobs went first.)
        own[entry] = (job_id, [rank for rank, _, _ in ranks])
        outcome = await self.batches.create(unit)
        if outcome.committed:
            for written, _ in unit:
                self._log("ack", key=written, job_id=job_id)
        else:
            own.pop(entry, None)
        return outcome

    async def _written_by(self, key: str, batch_id: str) -> bool:
        """Whether `key`'s value was stored by batch `batch_id` (its message's header)."""
        try:
            msg = await self._write(key, lambda: self.js.get_last_msg(
                f"KV_{self.bucket}", f"$KV.{self.bucket}.{key}"))
        except StateUnavailableError:
            return False  # (Taken for a retry, as before batches.)
        return bool(msg.headers) and msg.headers.get("Nats-Batch-Id") == batch_id

    async def _create_new(self, key: str, value: bytes) -> bool:
        """`_create_once`'s common case, a key created at once, without its loops; False: not.

        A registration makes two creates per rank, and the loops cost a tenth of them. Anything
        else (the key taken, JetStream busy or failing) is `_create_once`'s to decide, given
        when this try began: it creates the key again (a create that failed after it landed is
        then found and read, as `_write`'s retries find it), within the same `retry_s`.
        """
        try:
            await self._create(key, value)
        except Exception:  # noqa: BLE001 - taken, busy: the general way decides
            return False
        return True

    async def _create_once(self, key: str, value: bytes, same: Callable[[bytes], bool],
                           conflict: str, since: float | None = None) -> bool:
        """Create `key`; False if it already holds a value `same` accepts (a retry).

        A key another writer is creating right now (its write not yet readable) is read again
        once that write has landed, or created if it failed: waited for up to `retry_s`.
        `since`: when a first try of the create began (`_create_new`), for `_write`'s retries.

        Raises:
            DuplicateError: The key holds another value (`conflict` says why).
            StateUnavailableError: JetStream did not answer, or the other write never landed.
        """
        loop = asyncio.get_running_loop()
        deadline, pause = loop.time() + self.retry_s, 0.01
        while True:
            try:
                await self._write(key, lambda: self._create(key, value), since)
                return True
            except KeyWrongLastSequenceError:
                since = None  # (Later tries: `retry_s` each, as always.)
            entry = await self._write(key, lambda: self._read(key))
            if entry is not None:
                break
            if loop.time() + pause > deadline:
                raise StateUnavailableError(
                    f"another write of {key} did not land in {self.retry_s:g} s; nothing was "
                    "registered: retry in a moment")
            await asyncio.sleep(pause)
            pause = min(0.5, pause * 2)
        try:
            if same(entry.value):
                return False
        except (records.RecordError, AttributeError):
            pass
        raise DuplicateError(conflict)

    async def _read(self, key: str) -> Entry | None:
        """The key's entry now; None if it has no value (none yet, or deleted)."""
        from nats.js.errors import KeyNotFoundError

        try:
            return await self.kv.get(key)
        except KeyNotFoundError:
            return None

    async def put_progress(self, job_id: str, kind: str, state: Any,
                           version: int = records.VERSION) -> None:
        """Record a job's optimiser progress (raises StateUnavailableError).

        `version`: the job's layout (`records.layout_of`).
        """
        value = records.encode_progress(job_id, kind, state, version)
        revision = await self._write(f"the progress of job {job_id}",
                                     lambda: self.kv.put(records.progress_key(job_id), value))
        self._log("ack", key=records.progress_key(job_id), job_id=job_id, revision=revision)

    async def get_progress(self, job_id: str) -> dict[str, Any] | None:
        """A job's progress as recorded now, read from the stream's leader.

        A replica taking a job over reads it here rather than trusting its watch, which can lag
        behind after a stream leader election (raises StateUnavailableError).
        """
        from nats.js.errors import KeyNotFoundError

        key = records.progress_key(job_id)

        async def read() -> Any:
            try:
                return await self.kv.get(key)
            except KeyNotFoundError:
                return None

        entry = await self._write(f"the progress of job {job_id}", read)
        if entry is None:
            return None
        return records.decode(entry.key, entry.value, False, 0.0).progress

    async def get_job(self, job_id: str) -> JobRecord | None:
        """A job as recorded now (for a replica whose view has not caught up yet)."""
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await self.kv.get(records.job_key(job_id))
        except KeyNotFoundError:
            return None
        change = records.decode(entry.key, entry.value, False, 0.0)
        return change.job

    async def read_jobs(self, now_s: float = 0.0) -> dict[str, JobRecord]:
        """Every job with its ranks as recorded now.

        This reads the whole bucket: for checks and tools, not for the service (which follows
        the bucket instead).
        """
        from nats.js.errors import KeyNotFoundError

        keys = await bucket_keys(self.kv)
        jobs: dict[str, JobRecord] = {}
        ranks: list[tuple[str, RankRecord]] = []
        for key in keys:
            if not key.startswith("v."):
                continue  # (Uniqueness keys: the ranks are in the `v.` entries.)
            try:
                entry = await self.kv.get(key)
                change = records.decode(key, entry.value, False, now_s)
            except (KeyNotFoundError, records.RecordError):
                continue
            if change.job is not None:
                jobs[change.job.job_id] = change.job
            elif change.job_id is not None:  # One rank, or a node entry's.
                ranks += [(change.job_id, one.rank) for one in (change, *change.ranks)
                          if one.rank is not None]
        for job_id, rank in ranks:
            if job_id in jobs:
                jobs[job_id].add_rank(rank)
        return jobs

    async def delete_job(self, job_id: str) -> None:
        """Remove a job and everything recorded about it (its owner does this)."""
        await self.delete_hash(records.job_hash(job_id), f"job {job_id}")

    async def delete_hash(self, job_hash: str, what: str) -> None:
        """Remove every record of the job whose key token is `job_hash` (its quarantine too)."""
        self._log("delete", job_hash=job_hash)
        await self._write(f"the removal of {what}",
                          lambda: self.kv.delete(f"v.job.{job_hash}"))
        jsm = self.nc.jsm()
        stream = f"KV_{self.bucket}"
        for kind in records.MANY_KINDS:
            keys = records.hash_keys_filter(job_hash, kind)
            with contextlib.suppress(Exception):
                await jsm.purge_stream(stream, subject=f"$KV.{self.bucket}.{keys}")
        for kv, key in ((self.kv, f"v.prog.{job_hash}"),
                        *((self.kv, k) for k in records.budget_keys(job_hash)),
                        (self.kv, records.quarantine_key(job_hash)), (self.owners, job_hash)):
            with contextlib.suppress(Exception):
                await kv.purge(key)

    # ------------------------------------------------------------------ quarantine
    async def quarantine(self, job_hash: str, value: bytes) -> bool:
        """Set a job aside (`records.encode_quarantine`); False if it was already.

        Raises:
            StateUnavailableError: JetStream could not take it.
        """
        try:
            await self._write(f"the quarantine of job {job_hash}",
                              lambda: self._create(records.quarantine_key(job_hash), value))
        except KeyWrongLastSequenceError:
            return False
        return True

    async def get_quarantine(self, job_hash: str) -> dict[str, Any] | None:
        """The job's quarantine note as recorded now, or None (raises StateUnavailableError)."""
        from nats.js.errors import KeyNotFoundError

        async def read() -> Any:
            try:
                return await self.kv.get(records.quarantine_key(job_hash))
            except KeyNotFoundError:
                return None

        entry = await self._write(f"the quarantine of job {job_hash}", read)
        if entry is None or not entry.value:
            return None
        try:
            return records.decode(entry.key, entry.value, False, 0.0).quarantine
        except records.RecordError as e:  # Unreadable, yet written: still set aside.
            return {"job_id": None, "key": entry.key, "reason": f"unreadable note: {e}"}

    async def list_quarantine(self) -> dict[str, dict[str, Any]]:
        """Every quarantine note now, by job key token."""
        # (nats-py's `keys(filters=...)` matches substrings, not subjects: filter here.)
        keys = [k for k in await bucket_keys(self.kv) if k.startswith("v.quar.")]
        notes = {}
        for key in keys:
            job_hash = key.rsplit(".", 1)[-1]
            note = await self.get_quarantine(job_hash)
            if note is not None:
                notes[job_hash] = note
        return notes

    async def release_quarantine(self, job_hash: str) -> None:
        """Remove a job's quarantine note only (its replicas try to start it again)."""
        await self._write(f"the release of job {job_hash}",
                          lambda: self.kv.purge(records.quarantine_key(job_hash)))

    # ------------------------------------------------------------------ ownership
    async def read_lease(self, job_hash: str) -> tuple[bytes, int] | None:
        """A job's lease as the bucket holds it now: (value, revision); None if unknown.

        The watch brings every change, but it lags (or stalls while its server restarts): a
        compare-and-set that failed on a stale revision reads the key to learn the new one.
        """
        try:
            entry = await asyncio.wait_for(self.owners.get(job_hash), self.timeout_s)
        except Exception as e:  # noqa: BLE001 - a missing key, a timeout
            LOG.debug("lease %s not read: %s", job_hash, e)
            return None
        return (entry.value, int(entry.revision)) if entry.value else None

    async def take(self, job_hash: str, value: bytes, revision: int) -> int | None:
        """Take or renew a job's lease if its revision is still `revision` (0: no lease yet).

        Returns:
            The lease's new revision, or None if another replica changed it first (or
            JetStream did not answer: then nothing is assumed).
        """
        try:
            if revision == 0:
                new = int(await self.owners.create(job_hash, value))
            else:
                new = int(await self.owners.update(job_hash, value, last=revision))
            self._log("lease", job_hash=job_hash, value=value.decode(), revision=new)
            return new
        except Exception as e:  # noqa: BLE001 - a lost race, a timeout
            LOG.debug("lease %s at revision %d not taken: %s", job_hash, revision, e)
            return None
