"""Errors the engine raises for bad user input (the API maps them to 4xx)."""


class InvalidRequestError(ValueError):
    """A request can never be served as given (bad parameter, too long for the model or pool).

    ``param`` names the offending request field when there is one (OpenAI's error ``param``).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type, tuple[str, str | None]]:
        # Keep ``param`` across processes (the engine process reports errors pickled).
        return (type(self), (str(self), self.param))
