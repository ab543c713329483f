"""zeus_agent: the per-node GPU agent, the trainer publisher (`emit`) and the wire contract.

Packages: `wire` (subjects, payloads, codec), `gpu` (GPU interface, NVML and simulated
backends), `agent` (sans-I/O cores and the asyncio agent), `emit` (what training scripts
import), `integrations` (Zeus-shaped drop-ins), `broker` (embedded nats-server).

What a training script passes to `emit.init` is importable from here (and from `emit`):
`JobInfo` (the job's parallelism), `PowerLimitOptions` (the power-limit optimizer's options)
and `PowerLimitMeasurement` (a row of a profile given in `PowerLimitOptions.profile`)::

    from zeus_agent import JobInfo, PowerLimitOptions, emit

They are the models of `zeus_agent.models` and `zeus_agent.wire.messages`, imported when first
asked for: `import zeus_agent` alone imports neither pydantic models nor the wire codec.
"""

TYPE_CHECKING = False  # (`typing.TYPE_CHECKING` without importing typing: mypy reads it alike.)
if TYPE_CHECKING:
    from zeus_agent.models import JobInfo as JobInfo
    from zeus_agent.models import PowerLimitMeasurement as PowerLimitMeasurement
    from zeus_agent.wire.messages import PowerLimitOptions as PowerLimitOptions

__version__ = "0.1.0"

_PUBLIC = {
    "JobInfo": "zeus_agent.models",
    "PowerLimitMeasurement": "zeus_agent.models",
    "PowerLimitOptions": "zeus_agent.wire.messages",
}
"""The names this package exports lazily, and the module each lives in."""

__all__ = ["JobInfo", "PowerLimitMeasurement", "PowerLimitOptions", "__version__"]


if not TYPE_CHECKING:  # (Type checkers see the imports above, and no catch-all attribute.)

    def __getattr__(name: str) -> object:
        """Import a public model when it is first asked for (PEP 562)."""
        module = _PUBLIC.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        from importlib import import_module

        value = getattr(import_module(module), name)
        globals()[name] = value  # Asked once: later lookups find it without this function.
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *_PUBLIC})
