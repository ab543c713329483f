"""zeus_agent: the per-node GPU agent, the trainer publisher (`emit`) and the wire contract.

Packages: `wire` (subjects, payloads, codec), `gpu` (GPU interface, NVML and simulated
backends), `agent` (sans-I/O cores and the asyncio agent), `emit` (what training scripts
import), `integrations` (Zeus-shaped drop-ins), `broker` (embedded nats-server).
"""

__version__ = "0.1.0"
