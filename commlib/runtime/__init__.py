"""The runtime under the public API: groups and their resources (built once per group), the
progress loop and ``Work``, the plan cache of repeated calls, debug-mode agreement and the
timeout watchdog."""
