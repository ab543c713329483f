"""The coordinator's durable state: layout and ownership rules (pure), JetStream shell."""

from coordinator.state.ownership import Lease, OwnershipBook
from coordinator.state.records import Change, RecordError, bucket_names

__all__ = ["Change", "Lease", "OwnershipBook", "RecordError", "bucket_names"]
