"""The errors a checkpoint raises."""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted, tampered with or could not be
    written; the message names the file (and the manifest field) and the fix."""


class ModelMismatchError(CheckpointError, ValueError):
    """A complete checkpoint of another model (parameters, shapes, dtypes or groups)."""
