"""`zeus-demo`: both optimizers of the system in one command, with a report people can read.

Not part of the agent or the coordinator: a demonstration (and the engine of
`bench/perseus_savings.py`) built on them and on the simulated GPUs and trainers
(`zeus_agent.gpu.sim`).

One process runs everything on one asyncio loop: an embedded `nats-server` (or an external NATS
given by `--nats-url`), one `AgentServer` per simulated node (simulated GPUs, `backend="sim"`)
and a `CoordinatorService`. A simulated data-parallel job
(`zeus_agent.gpu.sim.trainers.data_parallel`: one process per rank, real `zeus_agent.emit`
calls) then runs under the power-limit optimizer. The demo follows the job's status events for
live progress and records the agents' per-step measurements; at the end it compares the steps
that ran at the maximum power limit (the baseline) with the steps that ran at the chosen limit
after it was pinned, prints a table and writes a report folder.

Then the pipeline part (`zeus_demo.pipeline`; `--skip-pipeline` leaves it out,
`--pipeline-only` runs only it): a simulated 1F1B pipeline job (GPT-3 stages fitted on the real
Perseus A40 profiles) runs at all-max SM clocks, then under the coordinator's Perseus scheduler
(online profiling, time-energy frontier, served plan); its table compares the two as the agents
measured them, next to the planner's prediction, and the report gets `pipeline_frontier.png`,
`pipeline_timeline.png` and a `pipeline` section in summary.json.

Modules:

* `config`: `DemoConfig`, every option, validated (`DemoConfigError` says which and how to fix
  it); the errors.
* `cli`: `build_parser()` (the command line; `--help` documents each option and its default)
  and `main(argv)`, the console script; the only place errors become exit codes (0 done, 1 the
  demo failed, 2 bad options, 3 NATS or a service did not start).
* `compare`: `StepStats`, `Comparison`, `compare(...)`: the pure arithmetic that joins each
  rank's per-step power limits (from the trainer) with the agents' per-step measurements by
  (rank, step): energy per step is the sum over the job's GPUs, time per step the maximum over
  ranks.
* `power_limit`: `run_demo(config, console)`, the asyncio shell of the power-limit part
  (start, run the job, collect, stop); returns a `DemoRun`.
* `report`: `build_summary`, `write_report`, `render_table`: the report (`summary.json`,
  `power_limits.png`, `profile.json`) and the table.
* `pipeline`: the pipeline part, and `PipelineCluster`, the engine of the savings bench.
"""
