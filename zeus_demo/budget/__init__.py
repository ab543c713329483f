"""A grid event on the simulated cluster: its jobs, and the judging of what happened."""
