"""The wire contract shared by the agent, the coordinator and trainers.

* `subjects`: NATS subject names (pure functions, configurable prefix, sanitised tokens).
* `messages`: pydantic v2 payload models with a schema version.
* `node_batch`: a node's marks and measurements of one job, a part per GPU.
* `codec`: the msgpack codec; `decode` raises one `PayloadError` that names the field.
* `text`: bounded texts (`shown`, `bounded`) for messages that echo what a peer sent.
* `trainer`: the local datagram protocol between trainers and their node's agent.
"""

from zeus_agent.wire import subjects
from zeus_agent.wire.codec import SCHEMA_VERSION, decode, encode, validate

__all__ = ["SCHEMA_VERSION", "decode", "encode", "subjects", "validate"]
