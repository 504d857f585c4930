"""The scheduler: requests, the prefill policy, and the plan of one step (SchedulerOutput)."""
