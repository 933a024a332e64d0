"""The errors of reading a model from disk or the hub: checkpoint.py, hub.py and quantization.py raise them."""


class CheckpointError(ValueError):
    """A checkpoint folder or file is missing, corrupt or unsupported; the message names it."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A required checkpoint folder or file does not exist."""
