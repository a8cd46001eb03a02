"""Errors a plugin raises to say that a model or checkpoint cannot be used; the message says why."""


class ModelError(RuntimeError):
    """The model cannot be used; the message names the problem."""


class ModelLoadError(RuntimeError):
    """A checkpoint could not be turned into a model; the message says what is wrong."""


class CheckpointNotFoundError(ModelLoadError, FileNotFoundError):
    """A checkpoint file (or a shard its index names) is missing."""


class MissingWeightsError(ModelLoadError):
    """The checkpoint left some of the model's parameters unloaded."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(f"the checkpoint has no weights for {len(names)} parameter(s): {', '.join(names)}")
        self.names = names
