"""The pipeline frequency optimiser (Perseus): the per-job core, the schedulers, the planner.

* `job`: `PipelineJob`, one DP x PP x TP job's optimisation (discover each rank's
  instructions, run the scheduler's schedules, observe, serve), with its phases as data in
  `phase` (`Phase`, `TRANSITIONS`), its ranks' iterations in `steps`, the stragglers it meets
  in `stragglers` and what it may keep in `memory`;
* `schedulers/`: the scheduler framework (`base`, `parallel3d`, `registry`, `settings`) and
  the schedulers (`point_solution`, `instruction_profiler`, `perseus`);
* `planner/`: the Perseus frontier planner (`profile`, `dag`, `graph`, `cut`, `frontier`,
  `points`);
* `paths`: where a job's files go (names only).

Sans-I/O, except for the modules that say they do I/O: `dumps` (writes a job's dumps and its
scheduler's files), `schedulers/settings` (reads `ZEUS_PFO_*`), `schedulers/plan_file` (reads
`PointSolution`'s plan) and `planner/profile_file` (reads a profile CSV). A test
(`tests/core/test_core_purity.py`) holds every other module to it.
"""
