"""Test doubles: `fake_pynvml` (a fake NVML module with per-device state)."""
