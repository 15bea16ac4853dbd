"""User-facing errors: each one is a single line that says what is wrong and how to fix it.

The CLI prints `error: <message>` and exits 2 for any KogError; nothing else is caught, so a
real bug still shows its traceback.
"""


class KogError(Exception):
    """A problem with the user's input or environment, explained in one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # always one line


class ConfigError(KogError):
    """A malformed or invalid config file or option."""


class PluginError(KogError):
    """An unknown or broken plugin, backend, model architecture, collective or sampler."""


class BackendUnavailable(KogError):
    """The selected backend's hardware or driver is missing on this machine."""


class CheckpointError(KogError):
    """A checkpoint that is missing, unreadable, or does not match its architecture."""


class ModelNotFound(KogError):
    """A model name that resolves to no local files."""


class ContextLengthExceeded(KogError):
    """A prompt (plus requested tokens) longer than the model's context."""


class CapabilityError(KogError):
    """The selected backend cannot run this model's decode program."""
