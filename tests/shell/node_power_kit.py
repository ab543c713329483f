"""What the `NodePower` budget tests publish: an agent's hello and a GPU's samples."""

from __future__ import annotations

from zeus_agent.wire import codec
from zeus_agent.wire.messages import AgentHello, GpuDescription, Sample, SampleBatch


def a40(index: int, uuid: str) -> GpuDescription:
    """An A40 (100-300 W) as an agent describes it."""
    return GpuDescription(index=index, uuid=uuid, name="A40", architecture="ampere",
                          min_power_limit_w=100, max_power_limit_w=300,
                          default_power_limit_w=300, supported_memory_clocks_mhz=[],
                          supported_graphics_clocks_mhz=[], has_energy_counter=True,
                          power_limit_w=300, controllable=True)


def hello_msg(node: str, gpus: int = 2, heartbeat_s: float = 0.3, agent_id: str = "",
              labels: dict[str, str] | None = None) -> AgentHello:
    """`node`'s announcement of `gpus` A40s."""
    return AgentHello(node=node, agent_id=agent_id or f"{node}-agent", backend="sim",
                      heartbeat_s=heartbeat_s, socket_path="/s",
                      gpus=[a40(i, f"{node}-u{i}") for i in range(gpus)], labels=labels or {})


def hello(node: str, gpus: int = 2, heartbeat_s: float = 0.3, agent_id: str = "") -> bytes:
    """`hello_msg`, encoded."""
    return codec.encode(hello_msg(node, gpus, heartbeat_s, agent_id))


def samples(node: str, gpu: int, power_w: float) -> bytes:
    """One sample of `node`'s GPU `gpu` drawing `power_w`, encoded."""
    sample = Sample(t_ns=1, energy_j=1.0, power_w=power_w, power_limit_w=300,
                    sm_clock_mhz=1000, memory_clock_mhz=1000)
    return codec.encode(SampleBatch(node=node, gpu=gpu, uuid=f"{node}-u{gpu}",
                                    samples=[sample]))
