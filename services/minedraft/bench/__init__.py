"""The benchmark harness behind `minedraft bench`."""

CHAOS_ROLES = ("drafter", "verifier", "scheduler", "gateway")  # the services `minedraft bench --chaos` kills
