"""Binding the coordinator's KV buckets at start, through a NATS cluster's busy moments (shell).

Replicas that start together on a NATS cluster race to create the buckets, and a cluster
creating a replicated stream, or electing its meta leader, can leave a request unanswered for
seconds. A replica must not die of that: it binds again (a bucket another replica created
meanwhile is found) until `retry_s` has passed. A server that has no JetStream, or refuses the
buckets outright, is said at once: no wait helps there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

LOG = logging.getLogger(__name__)

FIRST_PAUSE_S = 0.25
"""Pause before the first new try; it doubles up to `MAX_PAUSE_S`."""
MAX_PAUSE_S = 2.0


class NoJetStreamError(Exception):
    """The NATS server has no JetStream (the coordinator cannot keep its state there)."""


async def bind_bucket(js: Any, name: str, replicas: int, history: int = 1) -> Any:
    """The KV bucket `name`, created (file storage, `replicas` copies) if it does not exist."""
    from nats.js import api
    from nats.js.errors import BucketNotFoundError

    try:
        return await js.key_value(name)
    except BucketNotFoundError:
        pass
    config = api.KeyValueConfig(bucket=name, history=history, replicas=replicas,
                                storage=api.StorageType.FILE)
    return await js.create_key_value(config)


def _transient(e: BaseException, replicas: int) -> bool:
    """Whether binding again may succeed: a request unanswered, or a cluster not ready yet.

    `ServiceUnavailableError` is also what a server without JetStream answers; only on a
    cluster (`replicas` > 1) is it taken for a busy moment.
    """
    from nats.js.errors import ServiceUnavailableError

    return isinstance(e, TimeoutError | asyncio.TimeoutError) or (
        replicas > 1 and isinstance(e, ServiceUnavailableError))


async def bind_buckets(js: Any, names: list[str], replicas: int,
                       retry_s: float) -> list[Any]:
    """Bind (or create) each bucket of `names`, trying again for `retry_s` on busy moments.

    Raises:
        NoJetStreamError: The server has no JetStream, or refused the buckets, or stayed
            busy for `retry_s`.
    """
    from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

    deadline = time.monotonic() + retry_s
    pause = FIRST_PAUSE_S
    while True:
        try:
            return [await bind_bucket(js, name, replicas) for name in names]
        except (NoStreamResponseError, ServiceUnavailableError, TimeoutError) as e:
            if _transient(e, replicas) and time.monotonic() + pause < deadline:
                LOG.warning("binding the state buckets: JetStream did not answer (%s); "
                            "trying again in %.2f s", type(e).__name__, pause)
                await asyncio.sleep(pause)
                pause = min(2 * pause, MAX_PAUSE_S)
                continue
            raise NoJetStreamError(
                f"the NATS server did not answer JetStream requests ({type(e).__name__}): the "
                "coordinator keeps its state in JetStream; start nats-server with -js (or a "
                "`jetstream {}` block in its configuration), and give the coordinator's NATS "
                "user the JetStream permissions (`zeus-coordinator nats-auth` writes them)"
            ) from None
        except Exception as e:  # noqa: BLE001 - nats.js.errors.APIError and kin
            raise NoJetStreamError(
                f"JetStream refused the state buckets {', '.join(names)}: {e}") from None


async def bucket_keys(kv: Any, tries: int = 5) -> list[str]:
    """Every key `kv` holds now; [] for a bucket that holds none.

    nats-py's `KeyValue.keys()` can raise `NoKeysError` for a bucket that has keys: its watch
    can signal "nothing more" before messages already buffered are counted (nats-io/nats.py
    #842; seen in fresh-clone test runs on a loaded machine). An empty bucket holds no
    message at all, so only then is the answer [] at once; otherwise the listing is asked
    again (`tries` times, a little longer each time; a bucket of deleted keys only ends [] too).
    """
    from nats.js.errors import NoKeysError

    for attempt in range(tries):
        try:
            return list(await kv.keys())
        except NoKeysError:
            if not (await kv.status()).values:
                return []
            await asyncio.sleep(0.05 * (attempt + 1))
    return []
