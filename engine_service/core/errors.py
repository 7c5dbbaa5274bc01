"""The errors the engine raises for a request, by kind: the servicer maps each type to a gRPC
status code in one table (engine_service/serving/status.py); the offline API raises them as
they are (each request error is a ValueError)."""


class RequestError(ValueError):
    """A request the engine refuses. `field` names what was wrong ("prompt", "max_tokens", ...);
    the message reads "<field> must be <allowed>, got <value>"."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self):
        # Refusals cross from the engine core's process to the front pickled: keep the field.
        return type(self), (self.field, str(self))


class InvalidRequestError(RequestError):
    """A value no engine like this one accepts (the client must change the request)."""


class RequestTooLargeError(InvalidRequestError):
    """The request can never fit this engine's context or KV pool, however long it waits."""


class DuplicateRequestError(RequestError):
    """The request id is already live."""


class QueueFullError(RequestError):
    """Too many live requests now: retry later."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an unexpected error; nothing more will run."""
