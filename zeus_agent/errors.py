"""Errors of the `zeus_agent` package, split by what the caller does next, and their replies.

* `ReplyError`: base of every error a request is answered with; its class attribute `code` is
  the reply's code (a key of `zeus_agent.wire.messages.REPLY_CODES`). The coordinator's errors
  derive from it too.
* `reply_for(error)`: the `Reply` answering a request that raised `error`; the agent's GPU
  commands, its trainer gateway and the coordinator's endpoints all answer through it.
* `ZeusAgentError`: base of everything raised on purpose here (code `internal` unless a
  subclass says otherwise).
* `PayloadError`: a message or payload failed validation; the text names the field.
* `UnansweredError`: a service this one relays a request to did not answer.
* `ForbiddenError`: a request its sender may not make (another node's GPU, another process's
  binding, a sender without usable credentials).
* `BrokerError`: no NATS server could be started or reached.
* `ReadOnlyError`: a setting refused because the GPU is observed only (`--observe-only`, or no
  privilege to change it).
* `StaleLeaseError`: a command refused because its sender's ownership lease is over (the
  `Zeus-Lease` fencing token, `zeus_agent.agent.core.fencing`).
* `GPUError` and its subclasses: a GPU operation failed.
  * `GPUNotSupportedError`: the device or driver lacks the feature; do without it.
  * `GPUPermissionError`: a setter needs CAP_SYS_ADMIN or root; fix the deployment.
  * `GPUValueError`: the requested value is outside what the GPU accepts; pick another.
  * `GPUUnavailableError`: the device or driver is gone or not initialised; retry or replace.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zeus_agent.wire.messages import Reply

UNEXPECTED = "internal error; see the service's log"
"""`reply_for`'s message for an error without a code (a bug: its text may hold internals)."""


class ReplyError(Exception):
    """An error a request is answered with: `Reply.failure(code, str(error))`.

    Attributes:
        code: The reply's code, a key of `zeus_agent.wire.messages.REPLY_CODES`: a class
            attribute, each subclass sets its own (an error relaying another service's reply
            may carry that reply's code on the instance).
    """

    code: str = "internal"


def reply_for(error: BaseException, unexpected: str = UNEXPECTED) -> Reply:
    """The reply answering a request whose handling raised `error`.

    A `ReplyError` is answered with its `code` and its message (cut to fit); any other
    exception is a bug, answered `internal` with `unexpected` and nothing of its text (the
    caller logs it).
    """
    from zeus_agent.wire.messages import Reply

    if isinstance(error, ReplyError):
        return Reply.failure(error.code, str(error))
    return Reply.failure("internal", unexpected)


class ZeusAgentError(ReplyError):
    """Base class of every error raised on purpose by `zeus_agent`."""


class PayloadError(ZeusAgentError, ValueError):
    """A wire payload or user argument failed validation (code `bad_request`).

    Attributes:
        field: Dotted path of the offending field, or "" when the whole payload is bad.
    """

    code = "bad_request"

    def __init__(self, message: str, field: str = "") -> None:
        # Cut to fit a reply: a message may echo what a peer sent (a safety net; the code that
        # builds one echoes only `wire.text.shown` forms).
        from zeus_agent.wire.text import bounded

        super().__init__(bounded(message))
        self.field = bounded(field, 200)

    def within(self, what: str) -> PayloadError:
        """The same error, its message saying which request or message (`what`) held it."""
        return PayloadError(f"{what}: {self}", self.field)


class UnansweredError(ZeusAgentError):
    """A service this one relays a request to did not answer (code `unavailable`); retry."""

    code = "unavailable"


class ForbiddenError(ZeusAgentError):
    """A request its sender may not make (code `forbidden`).

    Another node's GPU, another process's binding, a sender without usable credentials.
    """

    code = "forbidden"


class BrokerError(ZeusAgentError):
    """A NATS server could not be started or reached."""


class GPUError(ZeusAgentError):
    """A GPU operation failed."""


class GPUNotSupportedError(GPUError):
    """The GPU or its driver does not support the operation."""

    code = "not_supported"


class GPUPermissionError(GPUError):
    """The operation needs privileges (CAP_SYS_ADMIN or root) the process lacks."""

    code = "permission"


class GPUValueError(GPUError, ValueError):
    """A requested setting is out of the GPU's range or not supported by it."""

    code = "out_of_range"


class GPUUnavailableError(GPUError):
    """The GPU or the driver is unavailable (lost, not initialised, timed out)."""

    code = "unavailable"


class SettingRefusedError(ZeusAgentError):
    """A setting refused because of who asks: e.g. a job whose trainer has left this GPU."""

    code = "conflict"


class TrainerLeftError(SettingRefusedError):
    """A job's setting refused because the job's trainer has left this GPU (code `trainer_left`).

    Its own code: a coordinator setting a job's limit again may cross the trainer's goodbye,
    which is no failure of the job's other GPUs.
    """

    code = "trainer_left"


class StaleLeaseError(SettingRefusedError):
    """A command refused as sent under an ownership lease that is over (code `stale_lease`).

    Its `Zeus-Lease` header's lease has ended by the agent's clock, or another owner's newer
    lease already commands the GPU: the sender no longer drives the job.
    """

    code = "stale_lease"


class ReadOnlyError(SettingRefusedError):
    """A setting refused because the GPU is observed only (code `read_only`).

    The agent runs with `--observe-only`, or found that it lacks the privilege to change the
    GPU's settings (NVML answered `NO_PERMISSION`): it measures, it never sets.
    """

    code = "read_only"
