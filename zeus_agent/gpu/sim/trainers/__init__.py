"""Simulated training jobs that drive the simulated GPUs: real processes, simulated work.

They stand in for a training script in the demos, the benches and the end-to-end tests; nothing
in the agent or the coordinator imports them.

* `data_parallel`: a data-parallel job, one process per rank, using `zeus_agent.emit` as a
  real script does (`run_data_parallel`).
* `pipeline`: a synchronous-1F1B pipeline job, one process per (replica, stage), using the
  `PerseusOptimizer` drop-in (`run_pipeline`; the command line
  `python -m zeus_agent.gpu.sim.trainers.pipeline`).
"""
