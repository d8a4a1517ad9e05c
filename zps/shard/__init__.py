"""The shard process: serves one partition as primary or replica, replicates, checkpoints."""
