"""What each rank sets up on its node: environment, process group, stop signals, strategies, precision, data sharding, watchdog."""
