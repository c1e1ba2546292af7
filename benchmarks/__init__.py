"""BlockTrain's benchmarks: scripts that print tables and write benchmarks/results/ (see README.md here)."""
