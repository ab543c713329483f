"""Errors of the `zeus_agent` package, split by what the caller does next.

* `ZeusAgentError`: base of everything raised on purpose here.
* `PayloadError`: a message or payload failed validation; the text names the field.
* `BrokerError`: no NATS server could be started or reached.
* `ReadOnlyError`: a setting refused because the GPU is observed only (`--observe-only`, or no
  privilege to change it).
* `GPUError` and its subclasses: a GPU operation failed.
  * `GPUNotSupportedError`: the device or driver lacks the feature; do without it.
  * `GPUPermissionError`: a setter needs CAP_SYS_ADMIN or root; fix the deployment.
  * `GPUValueError`: the requested value is outside what the GPU accepts; pick another.
  * `GPUUnavailableError`: the device or driver is gone or not initialised; retry or replace.
"""

from __future__ import annotations


class ZeusAgentError(Exception):
    """Base class of every error raised on purpose by `zeus_agent`."""


class PayloadError(ZeusAgentError, ValueError):
    """A wire payload or user argument failed validation.

    Attributes:
        field: Dotted path of the offending field, or "" when the whole payload is bad.
    """

    def __init__(self, message: str, field: str = "") -> None:
        # Cut to fit a reply: a message may echo what a peer sent (a safety net; the code that
        # builds one echoes only `wire.text.shown` forms).
        from zeus_agent.wire.text import bounded

        super().__init__(bounded(message))
        self.field = bounded(field, 200)


class BrokerError(ZeusAgentError):
    """A NATS server could not be started or reached."""


class GPUError(ZeusAgentError):
    """A GPU operation failed."""


class GPUNotSupportedError(GPUError):
    """The GPU or its driver does not support the operation."""


class GPUPermissionError(GPUError):
    """The operation needs privileges (CAP_SYS_ADMIN or root) the process lacks."""


class GPUValueError(GPUError, ValueError):
    """A requested setting is out of the GPU's range or not supported by it."""


class GPUUnavailableError(GPUError):
    """The GPU or the driver is unavailable (lost, not initialised, timed out)."""


class SettingRefusedError(ZeusAgentError):
    """A setting refused because of who asks: e.g. a job whose trainer has left this GPU."""


class TrainerLeftError(SettingRefusedError):
    """A job's setting refused because the job's trainer has left this GPU (code `trainer_left`).

    Its own code: a coordinator setting a job's limit again may cross the trainer's goodbye,
    which is no failure of the job's other GPUs.
    """


class ReadOnlyError(SettingRefusedError):
    """A setting refused because the GPU is observed only (code `read_only`).

    The agent runs with `--observe-only`, or found that it lacks the privilege to change the
    GPU's settings (NVML answered `NO_PERMISSION`): it measures, it never sets.
    """
