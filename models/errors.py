"""The one exception the model loader raises, so callers catch a single type before serving."""


class ModelLoadError(ValueError):
    """A model folder cannot be loaded; the message names the file, field or tensor at fault."""
