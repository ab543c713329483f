"""GPU backends: the `GPU` interface (`base`), `nvml` for real GPUs, `sim` for simulated ones."""
