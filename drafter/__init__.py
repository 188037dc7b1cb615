"""The DSpark drafter model: config, checkpoints, tensor-parallel layers and the reference draft step."""
