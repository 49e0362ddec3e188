"""Typed errors: every bad input maps to one of these, with a message that says what to fix."""


class RadixBackendError(Exception):
    """Base class of every error this package raises on purpose."""


class InvalidRequestError(RadixBackendError, ValueError):
    """The request itself is malformed (empty prompt, bad sampling value, bad constraint...)."""


class PromptTooLongError(InvalidRequestError):
    """Prompt plus max_new_tokens does not fit the model's context window."""


class KVCacheTooSmallError(InvalidRequestError):
    """One request needs more KV slots than the whole pool has: raise kv_cache_tokens."""


class ModelLoadError(RadixBackendError, OSError):
    """The model path does not exist or is not a loadable checkpoint."""


class ConstraintError(InvalidRequestError):
    """A regex / JSON schema / grammar / choices constraint could not be compiled."""


class EngineShutdownError(RadixBackendError, RuntimeError):
    """The engine was shut down; no new requests are accepted."""


class RequestAbortedError(RadixBackendError, RuntimeError):
    """The request was aborted before it finished."""


class MissingDependencyError(RadixBackendError, ImportError):
    """An optional extra is not installed; the message names the pip command to run."""

    @classmethod
    def for_extra(cls, package: str, extra: str) -> "MissingDependencyError":
        return cls(f"{package} is not installed. Install it with: pip install 'radix-backend[{extra}]'")
