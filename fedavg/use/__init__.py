"""Using merged models: offline merges of saved models, evaluation, prediction and its inputs."""
