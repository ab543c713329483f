"""The per-node agent: pure per-GPU cores (`core`) under an asyncio shell on NATS."""
