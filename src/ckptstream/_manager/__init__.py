"""CheckpointManager: its directory of steps, the ranks' agreement on a step, the writer lock."""
