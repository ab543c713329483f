"""Chaos soak: real partitions, power loss and pauses, and a checker that proves the guarantees.

* `checker`: pure; the agents' and coordinators' histories (`--history`) in, violations out.
* `netns`: network namespaces joined by veth pairs and a bridge, and the faults on them.
* `soak`: a 3-server NATS cluster, two coordinator replicas and sim agents in namespaces, two
  jobs, a seeded schedule of faults, and the checker's verdict (`bench/chaos.py`, the e2e test).
"""
